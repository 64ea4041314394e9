"""FP8 linears with current (just-in-time) scaling, the same numbers at every parallel layout.

`fp8.recipe` = tensorwise | rowwise turns the column- and row-parallel linears chosen by the filter
(`fp8_filter`) into FP8 GEMMs (`megalite.fp8.scaled_mm`); blockwise | mxfp8 into block-scaled GEMMs, emulated
(megalite/fp8/blocks.py has those recipes, their blocks per GEMM and why no amax of theirs is reduced: below is
tensorwise and rowwise). docs/fp8.md has the whole recipe; in short,
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

from megalite.fp8 import scaled_mm as smm
from megalite.fp8.blocks import block_mm, quantize_blocks
from megalite.fp8.costs import BLOCK, WEIGHT_BLOCK, Groups, Recipe, Splits
from megalite.fp8.scaled_mm import cast_scaled
from megalite.layers.linear_fn import Blocks, Fold
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


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

    def block_mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype, weight_rows: int | None = None) -> Tensor:
        """a @ b^T under a block recipe (megalite/fp8/blocks.py): a in 1 x B blocks, b in Bw x B blocks (Bw the
        recipe's weight block unless `weight_rows` says), both along the contraction dim."""
        b_len = BLOCK[self.recipe]
        rows = WEIGHT_BLOCK[self.recipe] if weight_rows is None else weight_rows
        return block_mm(quantize_blocks(a, 1, b_len, self.recipe), quantize_blocks(b, rows, b_len, self.recipe),
                        out_dtype)

    def grad_dtype(self) -> torch.dtype:
        return smm.E5M2 if self.recipe == "tensorwise" else smm.E4M3  # type: ignore[return-value]

    def linear_parts(self, x: Tensor, weight: Tensor, bias: Tensor | None, blocks: Blocks,
                     fold: Fold | None = None) -> tuple[Tensor, ...]:
        """`linear_fn.linear_parts` in FP8 (same arguments, same outputs)."""
        return _Fp8LinearParts.apply(x, weight, bias, blocks, fold, self)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, fold: Fold | None = None) -> Tensor:
        """`linear_fn.linear` in FP8."""
        return _Fp8LinearParts.apply(x, weight, bias, ((0, weight.shape[0]),), fold, self)[0]


def _with_bias(y: Tensor, bias: Tensor | None, lo: int, hi: int) -> Tensor:
    return y if bias is None else y + bias[lo:hi].to(y.dtype)


class _Fp8LinearParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                blocks: Blocks, fold: Fold | None, gemm: Fp8Gemm) -> tuple[Tensor, ...]:
        s, e4m3 = gemm.splits, smm.E4M3
        assert e4m3 is not None
        x2 = x.reshape(-1, x.shape[-1])
        ctx.blocks, ctx.x_shape, ctx.fold, ctx.gemm = blocks, x.shape, fold, gemm
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        if gemm.recipe in BLOCK:  # megalite/fp8/blocks.py: blocks along `in`, no amax reduced
            ctx.save_for_backward(x2, weight)
            y_all = gemm.block_mm(x2, weight, x.dtype)
            return tuple(_with_bias(y_all[:, lo:hi].contiguous(), bias, lo, hi).view(*x.shape[:-1], hi - lo)
                         for lo, hi in blocks)
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
            y = _with_bias(smm.scaled_mm(qx, qw[lo:hi].t(), sx, swi, x.dtype), bias, lo, hi)
            outs.append(y.view(*x.shape[:-1], hi - lo))
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
        tensorwise, block = gemm.recipe == "tensorwise", gemm.recipe in BLOCK
        if tensorwise:
            qx, sx, weight = ctx.saved_tensors
            qg, sg = gemm.quantize(g, gd, None, s.tokens + s.outer)
        else:
            x2, weight = ctx.saved_tensors
        dx = dw = db = None
        if need_x:  # first: a ZeRO-3 fold below may free the weight's storage
            if block:  # g per token and W^T along `out`
                dx = gemm.block_mm(g, weight.t(), ctx.x_dtype)
            elif tensorwise:
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
            if block:  # g^T and x^T along the tokens
                full = gemm.block_mm(g.t(), x2.t(), torch.float32, weight_rows=1)
            elif tensorwise:
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
