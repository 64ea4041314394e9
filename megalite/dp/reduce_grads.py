"""Gradient reduction, the global gradient norm and clipping over `.grad` tensors (the reference
optimizer's, `megalite.optim.reference`).

Order matters (a classic pitfall): reduce first, then measure the norm over all ranks, then clip.
How each parameter is treated comes from its `ParamSpec` (`megalite.parallel.param_spec`).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn as nn

from megalite.parallel import comm
from megalite.parallel.param_spec import GradReduction, ParamSpec, Tied
from megalite.parallel.state import ParallelState

Specs = Mapping[nn.Parameter, ParamSpec]

def unique_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with gradients, each once (a tied embedding/head is one parameter)."""
    return [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]


def reduce_gradients(model: nn.Module, state: ParallelState, specs: Specs) -> None:
    """Sum SP-partial grads over TP, then sum each grad over its `grad_group` (dp x cp for a dense model)
    and divide by the size of its `GradReduction.divisor_group`, one flat buffer per reduction.

    Under SP each TP rank saw 1/tp of the sequence, so replicated params (norms, row biases,
    positions) hold partial grads; Megatron all-reduces them over TP. The DP all-reduce of every
    gradient is DDP's 2 (N-1)/N Psi (one flat buffer; bucketing/overlap come with the gradient sync).
    """
    params = unique_params(model)
    partial = [p.grad for p in params if specs[p].sp_partial and p.grad is not None]
    if state.tp > 1 and partial:
        flat = torch.cat([g.reshape(-1) for g in partial])
        comm.all_reduce(flat, state, "tp")
        _unflatten_into(flat, partial)
    groups: dict[GradReduction, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(specs[p].grads, []).append(p.grad)
    for reduction, grads in groups.items():
        if state.size(reduction.group) > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, state, reduction.group)
            flat /= state.size(reduction.divisor_group)
            _unflatten_into(flat, grads)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def global_grad_norm(model: nn.Module, state: ParallelState, specs: Specs) -> float:
    """L2 norm of the full model's gradient, each parameter counted once: TP-replicated params
    only on tp rank 0, shards everywhere; summed over tensor and pipeline ranks, and over the ranks holding
    other parameters of a kind (`GradReduction.norm_group`: the experts of other ep ranks)."""
    counted = [p for p in unique_params(model) if p.grad is not None
               and (specs[p].layout.split or state.tp_rank == 0)
               and specs[p].tied is not Tied.HEAD_COPY]  # the last stage's copy of a tied embedding
    total = _squared_norm([p.grad for p in counted if specs[p].grads.norm_group(False) is None], state)
    for group in dict.fromkeys(g for p in counted if (g := specs[p].grads.norm_group(False)) is not None):
        pieces = [p.grad for p in counted if specs[p].grads.norm_group(False) == group]
        total += comm.all_reduce(_squared_norm(pieces, state), state, group, count_as="norm")
    comm.all_reduce(total, state, "mp")
    return math.sqrt(total.item())


def _squared_norm(grads: list[torch.Tensor | None], state: ParallelState) -> torch.Tensor:
    """[1] float64: the sum of squares of `grads`, one fused per-tensor norm pass (no float64 copy)."""
    norms = list(torch._foreach_norm([g.detach() for g in grads if g is not None])) if grads else []
    return (torch.stack(norms).double().pow(2).sum() if norms
            else torch.zeros((), dtype=torch.float64, device=state.device)).reshape(1)


def clip_gradients(model: nn.Module, max_norm: float, norm: float) -> None:
    """Scale every gradient by max_norm / norm when the (already global) norm exceeds max_norm."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return
    scale = max_norm / (norm + 1e-6)
    grads = [p.grad for p in unique_params(model) if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)


def sync_tied_embeddings(model: nn.Module, state: ParallelState, specs: Specs) -> None:
    """Sum the gradients of the two copies of a tied embedding (first and last pipeline stage) over
    the embedding group, so both copies take the same step and stay identical (Megatron-LM)."""
    if state.pp == 1:
        return
    for p in unique_params(model):
        if specs[p].pipeline_tied and p.grad is not None:
            comm.all_reduce(p.grad, state, "embedding")
