"""Turn TP shards back into full tensors (for parity tests, checkpoints and export).

Each parameter's `tp_layout` (set by the layers) says how it was cut; see `megalite.layers.linear`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.parallel import comm
from megalite.parallel.state import ParallelState


def unshard(shard: torch.Tensor, layout: tuple | None, state: ParallelState) -> torch.Tensor:
    """All-gather one parameter's shards over TP into the full tensor (uncounted layout bookkeeping
    is not skipped: these bytes are counted under 'tp' like any other)."""
    if layout is None or state.tp == 1:
        return shard.detach().clone()
    kind = layout[0]
    if kind == "row":
        return comm.all_gather(shard.detach(), state, "tp", dim=1)
    full = comm.all_gather(shard.detach(), state, "tp", dim=0)  # rank-major [p0_r0; p1_r0; ...; p0_r1; ...]
    if kind == "vocab":
        return full
    parts = [p // state.tp for p in layout[1]]
    per_rank = full.chunk(state.tp, dim=0)
    pieces = [r.split(parts, dim=0) for r in per_rank]
    return torch.cat([pieces[r][i] for i in range(len(parts)) for r in range(state.tp)], dim=0)


def full_state_dict(model: nn.Module, state: ParallelState, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, or their gradients, keyed by name; identical on every TP rank."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = unshard(t, getattr(p, "tp_layout", None), state)
    return out
