"""FP8 expert GEMMs of a mixture-of-experts layer: y[rows of e] = x[rows of e] W_e^T in e4m3, current scaling.

The dense linears' recipe (megalite/fp8/linear.py) scales activations and output gradients over the tokens of
a micro-batch, which every layout can reconstruct with a max all-reduce over cp (and tp). An expert's rows
are different: under expert parallelism the rank holding expert e receives the rows that *several* ranks'
micro-batches routed to e (the all-to-all of megalite/moe/dispatch.py), while the single-process run meets
those rows one micro-batch at a time. A scale taken over an expert's rows would therefore differ between
layouts. So the expert GEMMs use only scales that no layout changes:

    GEMM    computes          operands      activation / gradient scale   weight scale (tensorwise | rowwise)
    fprop   y_e  = x_e W_e^T  x, W e4m3     per token (amax over in)      per expert | per output row
    dgrad   dx_e = g_e W_e    g, W e4m3     per token (amax over out)     per expert | per input column
    wgrad   dW_e = g_e^T x_e  run dtype     (contracts over the tokens: no layout-free fp8 scale exists)

The weight is whole on the rank that holds it (experts are never split, only spread over 'ep' and replicated
over tp), so its scale needs no reduction either; no FP8 expert GEMM sends anything. The gradient is e4m3
under both recipes (a per-token scale follows its range; Micikevicius et al.'s e5m2 is for one scale per
tensor). The weight gradient runs in the run dtype, as the non-FP8 experts' does, and is returned in the
weight's dtype (fp32 master). Powers-of-two scales and the same cast as the dense path (`cast_scaled`).
Experts with no rows are skipped; their weight gradient is zero.

The block recipes (megalite/fp8/blocks.py) fit this rule as they are: activation and gradient blocks run along the
channels of one token (1 x 128, 1 x 32), and weight blocks lie within one expert, whole on its rank. Their GEMMs
are emulated like the dense linears' (`_grouped_blocks`).

The weight gradient is summed source rank by source rank (`sources`, from the dispatch: an expert's rows arrive
ordered by the ep rank that sent them), one GEMM each, in rank order: the association of a dense weight's
data-parallel gradient (each rank's part, then their sum). With one micro-batch per rank an ep run's expert
gradients are then bitwise the single process's, which matters more in FP8 than elsewhere: a round-off difference
can move a weight across an e4m3 rounding boundary, after which the runs part by far more than round-off
(tests/test_fp8_moe.py's module doc traces one such case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.autograd.function import once_differentiable

from megalite.fp8 import scaled_mm as smm
from megalite.fp8.blocks import block_mm, quantize_blocks
from megalite.fp8.costs import BLOCK, WEIGHT_BLOCK, Recipe
from megalite.fp8.scaled_mm import cast_scaled

Tensor = torch.Tensor


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows."""
    out, lo = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, lo, lo + n))
        lo += n
    return out


def _spans_in(counts: list[int], start: int) -> list[tuple[int, int]]:
    """(first row, end row) of every non-empty part of `counts` rows from row `start` on."""
    return [(start + lo, start + hi) for _, lo, hi in _spans(counts)]


def _quantize_weight(weight: Tensor, recipe: Recipe, dim: int) -> tuple[Tensor, Tensor]:
    """weight [E, out, in] in e4m3 and its dequantiser: one scale per expert ([E, 1, 1]) or one per slice
    along `dim` (amax over `dim`, the GEMM's contraction dim)."""
    assert smm.E4M3 is not None
    a = weight.detach().abs()
    amax = a.amax(dim=(1, 2), keepdim=True) if recipe == "tensorwise" else a.amax(dim=dim, keepdim=True)
    return cast_scaled(weight.detach(), amax.float(), smm.E4M3)


def _quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """t [N, K] in e4m3 with one scale per row ([N, 1])."""
    assert smm.E4M3 is not None
    return cast_scaled(t, t.abs().amax(dim=1, keepdim=True).float(), smm.E4M3)


def _grouped(qa: Tensor, sa: Tensor, qw: Tensor, sw: Tensor, counts: list[int], transpose: bool,
             width: int, dtype: torch.dtype) -> Tensor:
    """out[rows of e] = (qa * sa)[rows of e] @ (qw_e * sw_e)(^T) for every expert with rows, in `dtype`."""
    out = torch.zeros(qa.shape[0], width, dtype=dtype, device=qa.device)
    for e, lo, hi in _spans(counts):
        b, sb = (qw[e].t(), sw[e].t()) if transpose else (qw[e], sw[e])
        # A per-expert ([1, 1]) weight scale is expanded to [1, width]: the rowwise mode's shape.
        sb = sb.reshape(1, 1).expand(1, width) if sb.numel() == 1 else sb.reshape(1, width)
        out[lo:hi] = smm.scaled_mm(qa[lo:hi], b, sa[lo:hi], sb.contiguous(), dtype)
    return out


def _grouped_blocks(a: Tensor, weight: Tensor, counts: list[int], transpose: bool, recipe: Recipe,
                    dtype: torch.dtype) -> Tensor:
    """The block recipes' `_grouped` (megalite/fp8/blocks.py): a [N, K] in 1 x B blocks (per token), each expert's
    weight (W_e, or W_e^T when `transpose` is False) in Bw x B blocks along the contraction dim, within the expert."""
    b_len, rows = BLOCK[recipe], WEIGHT_BLOCK[recipe]
    qa = quantize_blocks(a, 1, b_len, recipe)
    w = weight.detach()
    width = w.shape[1] if transpose else w.shape[2]
    out = torch.zeros(a.shape[0], width, dtype=dtype, device=a.device)
    for e, lo, hi in _spans(counts):
        qw = quantize_blocks(w[e] if transpose else w[e].t(), rows, b_len, recipe)
        out[lo:hi] = block_mm(qa.row_slice(lo, hi), qw, dtype)
    return out


class _Fp8ExpertMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, counts: list[int],  # type: ignore[override]
                recipe: Recipe, sources: list[list[int]] | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.recipe, ctx.sources = counts, recipe, sources
        if recipe in BLOCK:
            return _grouped_blocks(x, weight, counts, True, recipe, x.dtype)
        qx, sx = _quantize_rows(x)
        qw, sw = _quantize_weight(weight, recipe, 2)  # per output row: amax over in
        return _grouped(qx, sx, qw, sw, counts, True, weight.shape[1], x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        counts: list[int] = ctx.counts
        g = g.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0] and ctx.recipe in BLOCK:
            dx = _grouped_blocks(g, weight, counts, False, ctx.recipe, x.dtype)
        elif ctx.needs_input_grad[0]:
            qg, sg = _quantize_rows(g)
            qw, sw = _quantize_weight(weight, ctx.recipe, 1)  # per input column: amax over out
            dx = _grouped(qg, sg, qw, sw, counts, False, weight.shape[2], x.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(weight)
            for e, lo, hi in _spans(counts):
                parts = [hi - lo] if ctx.sources is None else ctx.sources[e]
                for a, b in _spans_in(parts, lo):  # each source rank's rows one GEMM, summed in rank order
                    dw[e] += torch.mm(g[a:b].t(), x[a:b]).to(weight.dtype)
        return dx, dw, None, None, None


@dataclass(frozen=True)
class Fp8ExpertGemm:
    """The expert GEMMs of one MoE layer in FP8 (set on the experts by `megalite.fp8.enable.enable_fp8`)."""

    recipe: Recipe

    def expert_mm(self, x: Tensor, weight: Tensor, counts: list[int], sources: list[list[int]] | None = None) -> Tensor:
        """`megalite.moe.grouped.expert_mm` in FP8: x [N, in] sorted by expert, weight [E, out, in] (the fp32
        master: quantized from it, not from a run-dtype copy), counts [E] -> [N, out] in x's dtype. `sources[e]`:
        expert e's rows from each ep rank, in rank order (the dispatch's; None: one source)."""
        return _Fp8ExpertMM.apply(x, weight, counts, self.recipe, sources)


@runtime_checkable
class Fp8Experts(Protocol):
    """The slot a module of stacked experts (`megalite.moe.experts.Experts`) takes its FP8 GEMMs in; which
    modules those are, and the logical sizes the filter decides on, `enable_fp8` reads from the module's
    `ParamSpec.stack`s."""

    fp8: Fp8ExpertGemm | None
