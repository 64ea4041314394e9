"""The block recipes' quantisers, `fp8.recipe` = blockwise | mxfp8, and their emulated GEMM.

Every operand of a GEMM is cut into blocks along the GEMM's contraction dim; each block gets its own scale from its
own amax, so one outlier costs precision in its block only:

    recipe     activation / gradient blocks          weight blocks         scale                    payload
    blockwise  1 x 128 (per token, 128 channels)      128 x 128             fp32, 448 / amax         e4m3
    mxfp8      1 x 32                                 1 x 32                e8m0 (a power of two)    e4m3

blockwise is DeepSeek-V3's recipe (arXiv 2412.19437, sec. 3.3: fine-grained quantisation, e4m3 everywhere, the
gradients included); mxfp8 is the OCP Microscaling format (MX v1.0: 32 elements share one e8m0 exponent). In the
three GEMMs of a linear y = x W^T (x [T, in], W [out, in], g [T, out]) the blocks run along the contraction dim:

    GEMM    contraction   operands (blocks along the last dim as written)
    fprop   in            x [T, in] 1 x B,       W   [out, in] Bw x B
    dgrad   out           g [T, out] 1 x B,      W^T [in, out] Bw x B   (blockwise: the same blocks as fprop's W)
    wgrad   T             g^T [out, T] 1 x B,    x^T [in, T]   1 x B    (B-token blocks of each channel)

The arithmetic is torchao's pure-torch references, so scales and payloads match them bit for bit
(tests/test_fp8_blocks.py): blockwise as `torch_blockwise_scale_act_quant_lhs` / `..._weight_quant` (amax in fp64,
clamped at 1e-12, scale = 448 / amax rounded to fp32, dequantiser its fp32 reciprocal); mxfp8 as
`to_mx(..., scaling_mode=RCEIL)`, the mode of torchao's MXFP8 training recipe and of cuBLAS (NVIDIA's rule:
exponent = ceil(log2(amax / 448)), so no element saturates, unlike the spec's FLOOR mode). Edge blocks may be
partial (a dim not a multiple of the block): their amax is over the elements present.

No CPU GEMM takes block scales, so the GEMM is emulated: dequantise both operands (payload x its block's scale, in
fp32) and multiply in fp32 (`block_mm`). megalite uses this on every device (torch._scaled_mm's block-scaled modes,
CUDA-only, are not wired in: the training log says "emulated").

Layouts: a scale depends only on its block, so when no block spans two ranks, every rank quantises its pieces
exactly as the single process does and no amax is reduced. The tp-split dims (a column-parallel linear's output
parts, a row-parallel one's input) split into whole blocks per rank when each part is a multiple of tp x 128
(blockwise: its weight blocks are 128 along both dims) or tp x 32 (mxfp8); SP changes nothing (the tokens are
gathered before a column-parallel GEMM, a row-parallel output is reduced after it, and activation blocks run along
channels); cp splits the tokens, which only the wgrad blocks run along: each rank holds zigzag chunks of seq_len /
(2 cp) tokens, whole blocks when that is a multiple of B (and then the single process's B-token blocks, which start
at multiples of B within a sequence, are the same sets of tokens). dp, pp and ZeRO split no tensor a GEMM sees.
Config validation refuses the other layouts (`megalite.fp8.checks.block_layout_problems`) rather than reduce
the amax of a block shared by two ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalite.fp8 import scaled_mm as smm

Tensor = torch.Tensor
E8M0_BIAS = 127


def _cdiv(n: int, b: int) -> int:
    return -(-n // b)


def _expand(scale: Tensor, rows: int, cols: int, shape: torch.Size) -> Tensor:
    """A [cdiv(M, rows), cdiv(K, cols)] per-block tensor as [M, K] (each block's value over its elements)."""
    return scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def block_amax(t: Tensor, rows: int, cols: int) -> Tensor:
    """|t| maximum of each rows x cols block of t [M, K] ([cdiv(M, rows), cdiv(K, cols)], t's dtype); partial
    edge blocks are padded with zeros, which no amax can be below."""
    m, k = t.shape
    cm, ck = _cdiv(m, rows), _cdiv(k, cols)
    a = F.pad(t.abs(), (0, ck * cols - k, 0, cm * rows - m))
    return a.view(cm, rows, ck, cols).amax(dim=(1, 3))


def blockwise_scales(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(multiplier, dequantiser) per block, torchao's blockwise arithmetic: 448 / amax in fp64 (amax >= 1e-12),
    rounded to fp32; the dequantiser is the multiplier's fp32 reciprocal."""
    assert smm.E4M3 is not None
    mult = (torch.finfo(smm.E4M3).max / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return mult, 1.0 / mult


def mx_scales(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(multiplier, dequantiser) per block, torchao's RCEIL arithmetic: the e8m0 exponent e = ceil(log2(amax /
    448)) + 127 (255 for a NaN amax, 254 for an infinite one), the multiplier 2^(127 - e) (1 when e is 0), the
    dequantiser 2^(e - 127) (NaN when e is 255)."""
    assert smm.E4M3 is not None
    descale = amax.float() / torch.finfo(smm.E4M3).max
    exp = (torch.ceil(torch.log2(descale)).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    exp = torch.where(torch.isinf(descale), 254, torch.where(torch.isnan(descale), 255, exp)).to(torch.uint8)
    e = exp.to(torch.float32)
    mult = torch.where(exp == 255, descale, torch.where(
        exp == 254, 2.0 ** -127, torch.where(exp == 0, 1.0, torch.exp2(E8M0_BIAS - e))))
    dequant = torch.where(exp == 255, float("nan"), torch.pow(torch.full_like(e, 2.0), e - E8M0_BIAS))
    return mult, dequant


def e8m0(dequant: Tensor) -> Tensor:
    """An MX dequantiser (a power of two, 2^-127 .. 2^128, or NaN) as its e8m0 byte: the fp32 exponent field."""
    return ((dequant.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


@dataclass(frozen=True)
class Blocked:
    """A 2-D tensor in e4m3 with one dequantiser per rows x cols block (the contraction dim is the last)."""

    data: Tensor   # e4m3, the tensor's shape
    scale: Tensor  # fp32 [cdiv(M, rows), cdiv(K, cols)]
    rows: int
    cols: int

    def dequantize(self) -> Tensor:
        """payload x its block's dequantiser, in fp32."""
        return self.data.float() * _expand(self.scale, self.rows, self.cols, self.data.shape)

    def row_slice(self, lo: int, hi: int) -> Blocked:
        """Rows lo:hi of a tensor quantised row by row (rows == 1)."""
        assert self.rows == 1
        return Blocked(self.data[lo:hi], self.scale[lo:hi], 1, self.cols)


def quantize_blocks(t: Tensor, rows: int, cols: int, recipe: str) -> Blocked:
    """t [M, K] in e4m3 with a scale per rows x cols block by `recipe` (blockwise | mxfp8; module doc)."""
    assert smm.E4M3 is not None
    t = t.detach().contiguous()  # row-major payloads: the fp32 GEMM then sums in one order whatever t's strides
    amax = block_amax(t, rows, cols)
    mult, dequant = (blockwise_scales if recipe == "blockwise" else mx_scales)(amax)
    fmax = torch.finfo(smm.E4M3).max
    scaled = t.float() * _expand(mult, rows, cols, t.shape)
    return Blocked(scaled.clamp(-fmax, fmax).to(smm.E4M3), dequant, rows, cols)


def block_mm(a: Blocked, b: Blocked, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T (both [*, K], blocked along K) emulated: both dequantised in fp32, multiplied in fp32, rounded once
    to `out_dtype`."""
    return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)
