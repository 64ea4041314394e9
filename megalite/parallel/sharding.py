"""Turn TP shards back into full tensors (for parity tests, checkpoints and export).

Each parameter's `TPLayout` (its `ParamSpec`, declared by the layers) says how it was cut; see
`megalite.parallel.param_spec`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.errors import ConfigError
from megalite.parallel import comm
from megalite.parallel.param_spec import TPLayout, named_param_specs
from megalite.parallel.state import ParallelState


def unshard(shard: torch.Tensor, layout: TPLayout, state: ParallelState) -> torch.Tensor:
    """All-gather one parameter's shards over TP into the full tensor (uncounted layout bookkeeping
    is not skipped: these bytes are counted under 'tp' like any other)."""
    if not layout.split or state.tp == 1:
        return shard.detach().clone()
    kind = layout.kind
    if kind == "row":
        return comm.all_gather(shard.detach(), state, "tp", dim=1)
    full = comm.all_gather(shard.detach(), state, "tp", dim=0)  # rank-major [p0_r0; p1_r0; ...; p0_r1; ...]
    if kind == "vocab":
        return full
    parts = [p // state.tp for p in layout.parts]
    per_rank = full.chunk(state.tp, dim=0)
    pieces = [r.split(parts, dim=0) for r in per_rank]
    return torch.cat([pieces[r][i] for i in range(len(parts)) for r in range(state.tp)], dim=0)


def full_state_dict(model: nn.Module, state: ParallelState, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, or their gradients, keyed by name; identical on every TP rank."""
    specs = named_param_specs(model, ConfigError)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = unshard(t, specs[name].layout, state)
    return out
