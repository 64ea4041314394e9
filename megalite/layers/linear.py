"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, section 3).

A column-parallel linear splits the weight's output rows across TP ranks (Y_i = X A_i), a
row-parallel one splits its input columns (Y = sum_i X_i B_i). Chained column -> row, the pair needs
one all-reduce forward (g, after the row layer) and one backward (f, before the column layer).

Each layer declares how its parameters are cut (`param_specs()`, a `ParamSpec` per parameter, see
`megalite.parallel.param_spec`): the column weight and bias as a column layout of their logical parts
(e.g. q, k, v, each split separately), the row weight as a row layout, the row bias replicated (and,
under SP, with gradients that are partial sums over TP).

The matmuls run in `linear_fn` (one per logical part), or in the `Gemms` a caller swaps in (`set_gemms`:
FP8's, `megalite.fp8.linear`). Both layers implement the gradient sync's `FoldsWeightGrad` contract
(`megalite.dp.grad_sync`): a sync that keeps fp32 gradient buffers registers a fold with `set_wgrad_fold`,
and the weight gradient then goes straight into its buffer.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from megalite.layers.init import full_normal
from megalite.layers.linear_fn import TORCH_GEMMS, Fold, Gemms, linear, part_blocks
from megalite.parallel import comm
from megalite.parallel.param_spec import REPLICATED, ROW, ParamSpec, column
from megalite.parallel.state import ParallelState


class _WeightGradFold:
    """The fold slot both linears share: set by the gradient sync, passed to `linear_fn` on every call."""

    wgrad_fold: Fold | None = None

    def set_wgrad_fold(self, fold: Fold | None) -> None:
        """Let backward add the weight gradient into the gradient sync's buffer (`linear_fn`), or stop it (None)."""
        self.wgrad_fold = fold


class _SwappableGemms:
    """The matmuls both linears call (`linear_fn.Gemms`): torch's unless swapped (`linear_fn.TakesGemms`)."""

    gemms: Gemms = TORCH_GEMMS

    def set_gemms(self, gemms: Gemms | None) -> None:
        """Run this layer's matmuls with `gemms` (FP8: `megalite.fp8.enable.enable_fp8`), or torch's (None)."""
        self.gemms = TORCH_GEMMS if gemms is None else gemms


def _shard_rows(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=0)[rank]


class ColumnParallelLinear(_WeightGradFold, _SwappableGemms, nn.Module):
    """y = x A^T with A's output rows split over TP; `out_parts` fuse several logical outputs.

    Returns one tensor per part (a 1-tuple for a single part), each this rank's [..., part/tp] slice,
    contiguous: the parts share one parameter but not one output buffer.

    input_ready: the caller already applied f (or the SP all-gather) to x, e.g. when q/k/v or
    gate/up projections share one input: one collective instead of several.
    """

    def __init__(self, in_features: int, out_parts: list[int], state: ParallelState, *, name: str,
                 seed: int, std: float, bias: bool = False, input_ready: bool = False) -> None:
        super().__init__()
        tp = state.tp
        for p in out_parts:
            if p % tp:
                raise ValueError(f"{name}: output size {p} not divisible by tp={tp}")
        self.state, self.out_parts = state, list(out_parts)
        self.blocks = part_blocks([p // tp for p in out_parts])  # this rank's rows of each part
        self.input_ready = input_ready
        shards = [_shard_rows(full_normal((p, in_features), std, seed, f"{name}.{i}"), tp, state.tp_rank)
                  for i, p in enumerate(out_parts)]
        self.weight = nn.Parameter(torch.cat(shards, dim=0).contiguous())
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(out_parts) // tp))

    def param_specs(self) -> dict[str, ParamSpec]:
        spec = ParamSpec(column(self.out_parts))
        return {"weight": spec} if self.bias is None else {"weight": spec, "bias": spec}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.input_ready:
            x = enter_tp_region(x, self.state)
        return self.gemms.linear_parts(x, self.weight, self.bias, self.blocks, self.wgrad_fold)


class RowParallelLinear(_WeightGradFold, _SwappableGemms, nn.Module):
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
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))

    def param_specs(self) -> dict[str, ParamSpec]:
        weight = {"weight": ParamSpec(ROW)}
        # The bias is added after the reduction, replicated; under SP each rank adds it to 1/tp of the tokens.
        return weight if self.bias is None else weight | {"bias": ParamSpec(REPLICATED, sp_partial=self.state.sp)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exit_tp_region(self.gemms.linear(x, self.weight, fold=self.wgrad_fold), self.state)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class ReplicatedLinear(_WeightGradFold, nn.Module):
    """y = x W^T with W whole on every TP rank, applied to an input already made whole (`enter_tp_region`) and
    feeding only this rank's heads (MLA's down-projections, Kimi Delta Attention's low-rank gates): each rank
    back-propagates its heads' share, so its gradient is a partial sum over TP (`sp_partial`, all-reduced by
    the gradient sync)."""

    def __init__(self, in_features: int, out_features: int, state: ParallelState, *, name: str, seed: int,
                 std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(full_normal((out_features, in_features), std, seed, f"{name}.0"))
        self.partial = state.tp > 1

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec(REPLICATED, sp_partial=self.partial)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, fold=self.wgrad_fold)


def enter_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """f (TP) or the sequence all-gather (TP+SP): make x whole for a column-parallel matmul."""
    return comm.gather_from_sequence(x, state) if state.sp else comm.copy_to_tp(x, state)


def exit_tp_region(y: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """g (TP) or the sequence reduce-scatter (TP+SP): sum the row-parallel partial outputs."""
    return comm.reduce_scatter_to_sequence(y, state) if state.sp else comm.reduce_from_tp(y, state)
