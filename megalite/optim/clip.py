"""The global gradient norm and clipping: one rule for every optimizer (Pascanu et al. 2013, "On the
difficulty of training recurrent neural networks"; GPT-2 / Megatron-LM clip at 1.0).

Order matters (a classic pitfall): reduce the gradients first, then measure the norm over all ranks, then
clip. Each parameter counts once: a TP-replicated piece on tp rank 0 only, the last pipeline stage's copy
of a tied embedding never; the squares are summed over the tp x pp ranks ("mp") and, for each piece, over
the ranks holding other parts of the model of its kind (`GradReduction.norm_group`: a ZeRO-sharded
bucket's group, the experts of other ep ranks). `ZeroOptimizer` hands in its shards' segments
(`shard_pieces`), `ReferenceOptimizer` its parameters' `.grad`s (`param_pieces`): the same sum either way.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from megalite.dp.shards import Shard
from megalite.parallel import comm
from megalite.parallel.param_spec import ParamSpec, Tied
from megalite.parallel.state import GroupKind, ParallelState

Piece = tuple[torch.Tensor, GroupKind | None]  # a gradient (piece) this rank counts, the ranks its square adds over


def counted(replicated: bool, head_copy: bool, tp_rank: int) -> bool:
    """Whether this rank's piece enters the norm (each parameter once over tp and over a tied pair)."""
    return not ((replicated and tp_rank != 0) or head_copy)


def shard_pieces(shards: Sequence[Shard], state: ParallelState) -> list[Piece]:
    """The counted segments of the gradient sync's shards (padding belongs to none)."""
    return [(s.grad[g.lo:g.hi], s.norm_group) for s in shards for g in s.segments
            if counted(g.replicated, g.copy, state.tp_rank)]


def param_pieces(params: Iterable[nn.Parameter], specs: Mapping[nn.Parameter, ParamSpec],
                 state: ParallelState) -> list[Piece]:
    """The counted `.grad`s of replicated parameters (each whole on every rank of its group)."""
    return [(p.grad.detach(), specs[p].grads.norm_group(False)) for p in params if p.grad is not None
            and counted(not specs[p].layout.split, specs[p].tied is Tied.HEAD_COPY, state.tp_rank)]


def global_norm(pieces: Iterable[Piece], state: ParallelState) -> float:
    """The L2 norm of the whole model's reduced gradient, the same on every rank."""
    by_group: dict[GroupKind | None, list[torch.Tensor]] = {None: []}
    for t, group in pieces:
        by_group.setdefault(group, []).append(t)
    total: torch.Tensor | None = None
    for group, tensors in by_group.items():
        # One fused fp32 norm per piece (no float64 copy of the gradients), their squares summed in float64.
        norms = list(torch._foreach_norm(tensors)) if tensors else []
        sq = (torch.stack(norms).double().pow(2).sum().reshape(1) if norms
              else torch.zeros(1, dtype=torch.float64, device=state.device))
        if group is not None:
            comm.all_reduce(sq, state, group, count_as="norm")
        total = sq if total is None else total + sq
    assert total is not None
    comm.all_reduce(total, state, "mp")
    return math.sqrt(total.item())


def clip_grads(grads: Sequence[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale every gradient by max_norm / norm when the (already global) norm exceeds `max_norm` (> 0)."""
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm and grads:
        torch._foreach_mul_(list(grads), max_norm / (norm + 1e-6))
