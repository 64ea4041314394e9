"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, section 3).

A column-parallel linear splits the weight's output rows across TP ranks (Y_i = X A_i), a
row-parallel one splits its input columns (Y = sum_i X_i B_i). Chained column -> row, the pair needs
one all-reduce forward (g, after the row layer) and one backward (f, before the column layer).

Each parameter carries `tp_layout` for checkpointing/gathering:
  ("column", parts)  dim 0 is split; the weight is the concatenation of `parts` logical matrices
                     (e.g. q, k, v), each split separately, so [q_i; k_i; v_i] is rank i's shard
  ("row",)           dim 1 (input) is split
  None               replicated; `sp_partial=True` marks grads that are partial sums under SP

The matmuls run in `linear_fn` (one per logical part; the weight gradient can go straight into the
optimizer's fp32 buffer): every weight here is marked `wgrad_foldable`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.layers.init import full_normal
from megalite.layers.linear_fn import linear, linear_parts, part_blocks
from megalite.parallel import comm
from megalite.parallel.state import ParallelState


def _shard_rows(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=0)[rank]


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's output rows split over TP; `out_parts` fuse several logical outputs.

    Returns one tensor per part (a 1-tuple for a single part), each this rank's [..., part/tp] slice,
    contiguous: the parts share one parameter but not one output buffer.

    input_ready: the caller already applied f (or the SP all-gather) to x, e.g. when q/k/v or
    gate/up projections share one input: one collective instead of several.
    """

    def __init__(self, in_features: int, out_parts: list[int], state: ParallelState, *, name: str,
                 seed: int, std: float, bias: bool = False, gather_output: bool = False,
                 input_ready: bool = False) -> None:
        super().__init__()
        tp = state.tp
        for p in out_parts:
            if p % tp:
                raise ValueError(f"{name}: output size {p} not divisible by tp={tp}")
        self.state, self.out_parts = state, list(out_parts)
        self.blocks = part_blocks([p // tp for p in out_parts])  # this rank's rows of each part
        self.gather_output, self.input_ready = gather_output, input_ready
        shards = [_shard_rows(full_normal((p, in_features), std, seed, f"{name}.{i}"), tp, state.tp_rank)
                  for i, p in enumerate(out_parts)]
        self.weight = nn.Parameter(torch.cat(shards, dim=0).contiguous())
        self.weight.tp_layout = ("column", tuple(out_parts))  # type: ignore[attr-defined]
        self.weight.wgrad_foldable = True  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(out_parts) // tp))
            self.bias.tp_layout = ("column", tuple(out_parts))  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.input_ready:
            x = enter_tp_region(x, self.state)
        ys = linear_parts(x, self.weight, self.bias, self.blocks)
        if self.gather_output:
            ys = tuple(comm.gather_last_dim(y, self.state) for y in ys)
        return ys


class RowParallelLinear(nn.Module):
    """y = sum_i x_i B_i^T with B's input columns split over TP; x is already split (input is parallel).

    Without SP the partial outputs are all-reduced (g); with SP they are reduce-scattered along the
    sequence. The bias is replicated and added after the reduction (so it is added once).
    """

    def __init__(self, in_features: int, out_features: int, state: ParallelState, *, name: str,
                 seed: int, std: float, bias: bool = False) -> None:
        super().__init__()
        if in_features % state.tp:
            raise ValueError(f"{name}: input size {in_features} not divisible by tp={state.tp}")
        self.state = state
        full = full_normal((out_features, in_features), std, seed, f"{name}.0")
        self.weight = nn.Parameter(full.chunk(state.tp, dim=1)[state.tp_rank].contiguous())
        self.weight.tp_layout = ("row",)  # type: ignore[attr-defined]
        self.weight.wgrad_foldable = True  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            self.bias.tp_layout = None  # type: ignore[attr-defined]
            self.bias.sp_partial = state.sp  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exit_tp_region(linear(x, self.weight), self.state)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def enter_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """f (TP) or the sequence all-gather (TP+SP): make x whole for a column-parallel matmul."""
    return comm.gather_from_sequence(x, state) if state.sp else comm.copy_to_tp(x, state)


def exit_tp_region(y: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """g (TP) or the sequence reduce-scatter (TP+SP): sum the row-parallel partial outputs."""
    return comm.reduce_scatter_to_sequence(y, state) if state.sp else comm.reduce_from_tp(y, state)
