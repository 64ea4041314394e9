"""FP8 linears with current (just-in-time) scaling, the same numbers at every parallel layout.

`fp8.recipe` = tensorwise | rowwise turns the column- and row-parallel linears chosen by the filter
(`fp8_filter`) into FP8 GEMMs (`megalite.layers.scaled_mm`). docs/fp8.md has the whole recipe; in short,
for one linear y = x W^T with x [T, in] (T tokens), W [out, in], g = dL/dy [T, out]:

    GEMM    computes      operands (dtype)        tensorwise scale     rowwise scale (amax over the contraction dim)
    fprop   y  = x W^T    x e4m3, W e4m3          amax(x), amax(W)     x per token (over in), W per output row (over in)
    dgrad   dx = g W      g G,    W e4m3          amax(g), amax(W)     g per token (over out), W per input column (over out)
    wgrad   dW = g^T x    g G,    x e4m3          amax(g), amax(x)     g per output row (over T), x per input column (over T)

G is e5m2 under tensorwise (one scale for a whole gradient tensor needs e5m2's range, the
Micikevicius et al. 2022 recipe) and e4m3 under rowwise (a scale per row already follows the range, so
the extra mantissa bit wins, as in torchao's rowwise recipe and DeepSeek-V3's fine-grained one). Outputs:
y and dx in the run dtype, dW in fp32 (added into the fp32 main grad; master weights stay fp32). Scales
are powers of two (the largest 2^k with amax * 2^k <= the dtype's max), so scaling is exact and the
only rounding is the cast to fp8; a non-finite amax leaves the inf/nan in place for the step-skip logic.

Layout invariance: an amax taken over a dimension that a parallel layout splits is max-all-reduced over
the group splitting it (`comm.all_reduce(op=MAX)`, counted under that group's key). At the GEMMs the
token dim is split over cp only (SP's pieces are gathered before a column-parallel GEMM, and a
row-parallel GEMM's output is reduced after it); a column-parallel linear splits `out` over tp, a
row-parallel one `in`. So (`Splits`): tensorwise x/W/g reduce over every group splitting the tensor;
rowwise scales reduce over the group splitting their contraction dim only: column-parallel fprop none,
dgrad tp (g per token and W per column both span the tp-split `out`), wgrad cp; row-parallel fprop tp
(x per token and W per row span the tp-split `in`), dgrad none, wgrad cp. Data parallelism splits no
tensor: a scale covers one micro-batch, as in the single-process run.

Zero-bubble deferral: an FP8 linear computes its weight gradient in B (exact, not deferred).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.function import once_differentiable

from megalite.layers import scaled_mm as smm
from megalite.layers.scaled_mm import Recipe, cast_scaled
from megalite.layers.linear_fn import Blocks, Fold, TakesGemms
from megalite.parallel import comm
from megalite.parallel.param_spec import DeclaresParamSpecs
from megalite.parallel.state import GroupKind, ParallelState

Tensor = torch.Tensor
FP8_CHOICES = ("none", "tensorwise", "rowwise")
Groups = tuple[GroupKind, ...]


@dataclass(frozen=True)
class Splits:
    """The groups splitting each dimension of a linear's 2-D operands at its GEMMs."""

    tokens: Groups  # T (cp)
    inner: Groups   # in (tp for a row-parallel linear)
    outer: Groups   # out (tp for a column-parallel linear)


@dataclass(frozen=True)
class Fp8Gemm:
    """One linear's FP8 matmuls: its recipe, its layout's splits and the state to reduce amaxes over."""

    recipe: Recipe
    splits: Splits
    state: ParallelState

    def quantize(self, t: Tensor, dtype: torch.dtype, dim: int | None, groups: Groups) -> tuple[Tensor, Tensor]:
        """t in `dtype` and its dequantiser: one scale (dim None) or one per slice along `dim` (kept as
        size 1), the amax max-reduced over `groups`."""
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        amax = amax.float()
        for g in groups:
            comm.all_reduce(amax, self.state, g, op=dist.ReduceOp.MAX)
        return cast_scaled(t, amax, dtype)

    def grad_dtype(self) -> torch.dtype:
        return smm.E5M2 if self.recipe == "tensorwise" else smm.E4M3  # type: ignore[return-value]

    def linear_parts(self, x: Tensor, weight: Tensor, bias: Tensor | None, blocks: Blocks,
                     fold: Fold | None = None) -> tuple[Tensor, ...]:
        """`linear_fn.linear_parts` in FP8 (same arguments, same outputs)."""
        return _Fp8LinearParts.apply(x, weight, bias, blocks, fold, self)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, fold: Fold | None = None) -> Tensor:
        """`linear_fn.linear` in FP8."""
        return _Fp8LinearParts.apply(x, weight, bias, ((0, weight.shape[0]),), fold, self)[0]


class _Fp8LinearParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                blocks: Blocks, fold: Fold | None, gemm: Fp8Gemm) -> tuple[Tensor, ...]:
        s, e4m3 = gemm.splits, smm.E4M3
        assert e4m3 is not None
        x2 = x.reshape(-1, x.shape[-1])
        if gemm.recipe == "tensorwise":
            qx, sx = gemm.quantize(x2, e4m3, None, s.tokens + s.inner)
            qw, sw = gemm.quantize(weight, e4m3, None, s.outer + s.inner)
            sw_rows = [sw for _ in blocks]
            ctx.save_for_backward(qx, sx, weight)
        else:
            qx, sx = gemm.quantize(x2, e4m3, 1, s.inner)       # [T, 1]
            qw, sw = gemm.quantize(weight, e4m3, 1, s.inner)   # [out, 1]
            sw_rows = [sw[lo:hi].t() for lo, hi in blocks]
            ctx.save_for_backward(x2, weight)
        outs = []
        for (lo, hi), swi in zip(blocks, sw_rows):
            y = smm.scaled_mm(qx, qw[lo:hi].t(), sx, swi, x.dtype)
            if bias is not None:
                y = y + bias[lo:hi].to(x.dtype)
            outs.append(y.view(*x.shape[:-1], hi - lo))
        ctx.blocks, ctx.x_shape, ctx.fold, ctx.gemm = blocks, x.shape, fold, gemm
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        gemm: Fp8Gemm = ctx.gemm
        s, e4m3, gd = gemm.splits, smm.E4M3, gemm.grad_dtype()
        assert e4m3 is not None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]
        g = gs[0] if len(gs) == 1 else torch.cat(gs, dim=1)  # [T, out]: one GEMM over every part
        tensorwise = gemm.recipe == "tensorwise"
        if tensorwise:
            qx, sx, weight = ctx.saved_tensors
            qg, sg = gemm.quantize(g, gd, None, s.tokens + s.outer)
        else:
            x2, weight = ctx.saved_tensors
        dx = dw = db = None
        if need_x:  # first: a ZeRO-3 fold below may free the weight's storage
            if tensorwise:
                qw, sw = gemm.quantize(weight, e4m3, None, s.outer + s.inner)
                dx = smm.scaled_mm(qg, qw, sg, sw, ctx.x_dtype)
            else:
                qgr, sgr = gemm.quantize(g, gd, 1, s.outer)          # [T, 1]
                qw, sw = gemm.quantize(weight, e4m3, 0, s.outer)     # [1, in]
                dx = smm.scaled_mm(qgr, qw, sgr, sw, ctx.x_dtype)
            dx = dx.view(ctx.x_shape)
        if need_b:
            db = (gs[0].sum(0) if len(gs) == 1 else torch.cat([gi.sum(0) for gi in gs])).to(ctx.bias_dtype)
        if need_w:
            if tensorwise:
                full = smm.scaled_mm(qg.t(), qx, sg, sx, torch.float32)
            else:
                qgc, sgc = gemm.quantize(g, gd, 0, s.tokens)         # [1, out]
                qxc, sxc = gemm.quantize(x2, e4m3, 0, s.tokens)      # [1, in]
                full = smm.scaled_mm(qgc.t(), qxc, sgc.t(), sxc, torch.float32)
            fold: Fold | None = ctx.fold
            if fold is not None:
                def add(main: Tensor) -> None:
                    main.add_(full)
                fold(add)
            else:
                dw = full.to(weight.dtype)
        return dx, dw, db, None, None, None


def amax_reductions(recipe: Recipe, splits: Splits, tokens: int, in_local: int, out_local: int) -> list[tuple[Groups, int]]:
    """(groups, fp32 elements) of every amax all-reduce one linear call makes, forward and backward (input
    and weight gradients both needed): what `Fp8Gemm.quantize` sends, for the estimator and the tests."""
    s = splits
    if recipe == "tensorwise":  # x, W (fprop); g, W again (dgrad); wgrad reuses g's and x's
        return [(s.tokens + s.inner, 1), (s.outer + s.inner, 1), (s.tokens + s.outer, 1), (s.outer + s.inner, 1)]
    return [(s.inner, tokens), (s.inner, out_local),     # fprop: x per token, W per row
            (s.outer, tokens), (s.outer, in_local),      # dgrad: g per token, W per column
            (s.tokens, out_local), (s.tokens, in_local)]  # wgrad: g per output row, x per input column


@dataclass(frozen=True)
class Fp8Settings:
    """`fp8.recipe` and its filter: a linear runs in FP8 when it is not the output layer and
    min(in_features, every output part) >= min_dim, on the logical (unsharded) shape so that every
    layout makes the same choice."""

    recipe: Recipe
    min_dim: int


def fp8_settings(recipe: str, min_dim: int) -> Fp8Settings | None:
    """`fp8.recipe` / `fp8.min_dim` as settings (None for "none"); validation has checked the name."""
    if recipe == "none":
        return None
    if recipe not in ("tensorwise", "rowwise"):
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {FP8_CHOICES}")
    return Fp8Settings(cast(Recipe, recipe), min_dim)


def fp8_filter(name: str, in_features: int, out_parts: list[int], min_dim: int) -> bool:
    """Whether the linear `name` (a module path) with these logical sizes runs in FP8."""
    if name == "head" or name.endswith(".head"):  # the output layer stays in the run dtype (torchao, TE)
        return False
    return min([in_features, *out_parts]) >= min_dim


def linear_shapes(module: nn.Module) -> tuple[str, int, list[int]] | None:
    """('column' | 'row', logical in_features, logical output parts) of a parallel linear, else None."""
    from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column", module.weight.shape[1], list(module.out_parts)
    if isinstance(module, RowParallelLinear):
        return "row", module.weight.shape[1] * module.state.tp, [module.weight.shape[0]]
    return None


def stacked_dims(module: nn.Module) -> list[int]:
    """Every logical size of the matrices `module`'s own parameters stack (`ParamSpec.stack`: the MoE experts'
    hidden and ffn sizes); empty for a module holding no stack."""
    if not isinstance(module, DeclaresParamSpecs):
        return []
    specs = module.param_specs()
    stacks = [(specs[n].stack, p) for n, p in module.named_parameters(recurse=False) if n in specs]
    return [d for stack, p in stacks if stack is not None for d in stack.dims(p.shape[-1])]


def enable_fp8(chunks: list[nn.Module], settings: Fp8Settings | None, state: ParallelState) -> list[str]:
    """Give every filtered parallel linear of `chunks` its `Fp8Gemm`, and every filtered module of experts its
    `Fp8ExpertGemm` (megalite/layers/fp8_experts.py; None settings: leave all in the run dtype); returns the
    names of the FP8 modules."""
    from megalite.layers.fp8_experts import Fp8ExpertGemm, Fp8Experts

    if settings is None:
        return []
    smm.check_available()
    tokens: Groups = ("cp",) if state.cp > 1 else ()
    tp: Groups = ("tp",) if state.tp > 1 else ()
    chosen = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            dims = stacked_dims(module)
            if dims and isinstance(module, Fp8Experts):  # its GEMMs share the rule: min(hidden, ffn)
                if fp8_filter(name, dims[0], dims[1:], settings.min_dim):
                    module.fp8 = Fp8ExpertGemm(settings.recipe)
                    chosen.append(name)
                continue
            shapes = linear_shapes(module)
            if (shapes is None or not isinstance(module, TakesGemms)
                    or not fp8_filter(name, shapes[1], shapes[2], settings.min_dim)):
                continue
            kind = shapes[0]
            splits = Splits(tokens, tp if kind == "row" else (), tp if kind == "column" else ())
            module.set_gemms(Fp8Gemm(settings.recipe, splits, state))
            chosen.append(name)
    return chosen
