"""RNG streams for dropout under tensor/sequence parallelism (Megatron's `CudaRNGStatesTracker`).

Outside TP regions activations are replicated across TP ranks, so their dropout masks must be
equal on every TP rank: the *replicated* stream (torch's default generator, seeded identically on
the TP ranks of a stage). Inside TP regions, and on sequence-parallel slices, each rank holds a
different piece, so it uses a *tp-local* stream seeded by its tp rank. Both are reproducible from
`train.seed` and the layout, so a run with dropout on can be repeated exactly.
"""

from __future__ import annotations

import torch

from megalite.parallel.state import ParallelState


class RNGStreams:
    """Owns the tp-local dropout generator; the replicated stream is torch's default one."""

    def __init__(self, seed: int, state: ParallelState) -> None:
        self.replicated_seed = seed + 100 * state.pp_rank
        self.tp_local = torch.Generator(device=state.device).manual_seed(
            seed + 2718 + 100 * state.pp_rank + state.tp_rank)
        torch.manual_seed(self.replicated_seed)

    def dropout(self, x: torch.Tensor, p: float, training: bool, tp_local: bool) -> torch.Tensor:
        """Inverted dropout drawing from the right stream."""
        if not training or p == 0.0:
            return x
        gen = self.tp_local if tp_local else None
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= p
        return x * keep.to(x.dtype) / (1.0 - p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"tp_local": self.tp_local.get_state(), "default": torch.get_rng_state()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.tp_local.set_state(d["tp_local"])
        torch.set_rng_state(d["default"])
