"""RNG streams for dropout under tensor/sequence parallelism (Megatron's `CudaRNGStatesTracker`).

Outside TP regions activations are replicated across TP ranks, so their dropout masks must be
equal on every TP rank: the *replicated* stream, seeded identically on the TP ranks of a stage. Inside
TP regions, and on sequence-parallel slices, each rank holds a different piece, so it uses a *tp-local*
stream seeded by its tp rank. Both are reproducible from `train.seed` and the layout, so a run with
dropout on can be repeated exactly.

Both streams are `torch.Generator`s owned by `RNGStreams`: building a model (which builds one) reads and
writes no global RNG state, so it cannot change what unrelated code draws from torch's default generator.
The replicated stream draws exactly what torch's default generator would after `torch.manual_seed` with
the same seed (the same engine, seeded the same way).

Activation recompute replays both streams itself (see `GPT._replayable`): torch's checkpoint restores only
the global generators.
"""

from __future__ import annotations

import torch

from megalite.parallel.state import ParallelState


class RNGStreams:
    """This rank's two dropout generators, on the rank's device."""

    def __init__(self, seed: int, state: ParallelState) -> None:
        # Context-parallel ranks hold other tokens of the same sequences: their masks must differ too (the
        # cp term is 0 at cp_rank 0, so layouts without cp draw what they always drew).
        base = seed + 100 * state.pp_rank + 7919 * state.cp_rank
        self.replicated = torch.Generator(device=state.device).manual_seed(base)
        self.tp_local = torch.Generator(device=state.device).manual_seed(base + 2718 + state.tp_rank)

    def dropout(self, x: torch.Tensor, p: float, training: bool, tp_local: bool) -> torch.Tensor:
        """Inverted dropout drawing from the right stream."""
        if not training or p == 0.0:
            return x
        gen = self.tp_local if tp_local else self.replicated
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= p
        return x * keep.to(x.dtype) / (1.0 - p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both generator states, under the checkpoint format's keys ("default" is the replicated stream)."""
        return {"tp_local": self.tp_local.get_state(), "default": self.replicated.get_state()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.tp_local.set_state(d["tp_local"])
        self.replicated.set_state(d["default"])
