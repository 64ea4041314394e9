"""MoE state in checkpoints: where a rank's experts sit in the global tensors (expert parallelism cuts dim 0),
and the routers' bias buffers.

A stacked expert weight ([E/ep, ...] on each rank, `experts.Experts`) is stored as the whole [E, ...]
tensor; rank ep_rank holds rows [ep_rank * E/ep, (ep_rank + 1) * E/ep) (`GradReduction.split_over`). The ranks
of its gradient group hold the same experts: they deal the writes among themselves, as dp x cp does for the rest.
So a checkpoint saved at one ep loads at any other (every expert's tensor is complete on disk), and the
offline tool needs no ep: its files are per (tp, pp) rank and every ep rank reads its rows from one of them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from megalite.checkpoint.layout import Piece, ShardMap
from megalite.parallel.param_spec import ROW, ParamSpec, TPLayout, column, logical_name
from megalite.parallel.state import ParallelState


def routing_buffers(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(global name, tensor) of the state a MoE model keeps outside its parameters: DeepSeek's router bias
    (replicated over tp, dp and ep; one per layer), stored as "buffer/<name>" so a resumed run routes alike."""
    out = []
    for chunk in chunks:
        for name, buf in chunk.named_buffers():
            if name.endswith("router.bias"):
                out.append((logical_name(name), buf))
    return out


def expert_shard_map(smap: ShardMap, spec: ParamSpec, state: ParallelState) -> ShardMap:
    """`smap` (the TP view of this rank's tensor) lifted into the whole-expert tensor when `spec` is split
    along dim 0 over other ranks too (`GradReduction.split_over`: an expert weight over ep); unchanged otherwise."""
    split = spec.grads.split_over
    ep = state.size(split) if split else 1
    if split is None or ep == 1:
        return smap
    local = smap.local_shape[0]
    start = state.rank_in(split) * local
    pieces = tuple(Piece(pc.local, (pc.glob[0] + start,) + pc.glob[1:], pc.shape) for pc in smap.pieces)
    return replace(smap, global_shape=(smap.global_shape[0] * ep,) + smap.global_shape[1:], pieces=pieces)


def shared_expert_layout(name: str, shape: tuple[int, ...], arch: str) -> TPLayout | None:
    """The TP layout of DeepSeek's shared experts (`layer.MoELayer.shared`, a dense MLP of their fused width,
    which the model dims do not record, so it is read from the tensor's shape); None for any other name."""
    name = logical_name(name)
    if name.endswith("mlp.shared.up.weight") or name.endswith("mlp.shared.up.bias"):
        return column((shape[0] // 2, shape[0] // 2) if arch == "llama" else (shape[0],))
    if name.endswith("mlp.shared.down.weight"):
        return ROW
    return None
