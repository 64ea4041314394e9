"""Gradient reduction over `.grad` tensors, the direct way (the reference optimizer's,
`megalite.optim.reference`): one flat all-reduce per reduction group after the last micro-batch, where the
gradient sync (`grad_sync`) buckets, overlaps and shards. How each parameter is treated comes from its
`ParamSpec` (`megalite.parallel.param_spec`).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from megalite.parallel import comm
from megalite.parallel.param_spec import GradReduction, ParamSpec
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


def sync_tied_embeddings(model: nn.Module, state: ParallelState, specs: Specs) -> None:
    """Sum the gradients of the two copies of a tied embedding (first and last pipeline stage) over
    the embedding group, so both copies take the same step and stay identical (Megatron-LM)."""
    if state.pp == 1:
        return
    for p in unique_params(model):
        if specs[p].pipeline_tied and p.grad is not None:
            comm.all_reduce(p.grad, state, "embedding")
