"""Checks and layouts for torch's private FP8 GEMM, `torch._scaled_mm` (called in `megalite.torch_private`).

    out = (a.float() * scale_a) @ (b.float() * scale_b)   rounded once to `out_dtype`

with a [M, K] and b [K, N] float8 (e4m3 or e5m2, never both e5m2), and the scales fp32 dequantisation
multipliers: tensorwise ([] or [1, 1] each) or rowwise (scale_a [M, 1], scale_b [1, N]).

What torch 2.13 supports, checked on this pin (tests/test_fp8.py's first test asserts each line):
- CPU: every mode megalite uses: tensorwise and rowwise scales, e4m3 x e4m3 and e5m2 x e4m3 (either side),
  any memory layout, fp32 / bf16 output. The CPU kernel dequantises and multiplies in fp32, so its result
  is bitwise `(a.float() * scale_a) @ (b.float() * scale_b)`: the plain-torch emulation the tests compare
  against is exact, not approximate.
- CUDA (cuBLASLt / CUTLASS, compute capability >= 8.9): `a` row-major and `b` column-major, dimensions
  multiples of 16, no e5m2 x e5m2, and rowwise scaling only with a bf16 output. `scaled_mm` gives every
  call those layouts, and for a rowwise call asking for another output dtype it asks for bf16 and casts
  (the one mode CUDA lacks; the emulation of that mode is exactly "round to bf16, then cast").
- Under torch.compile (`model.compile`), inductor's `_scaled_mm` lowering refuses any other layout whatever the
  device (torch 2.13: "mat_b must be col_major"), so a traced call gets them on CPU too (a copy the graph plans).

The power-of-two current scales both FP8 paths cast with (`pow2_scale`, `cast_scaled`) live here too, below the
dense linears (megalite/fp8/linear.py) and the expert GEMMs (megalite/fp8/experts.py).

`check_available()` is what config validation and the tests call: a torch without `_scaled_mm` or the
float8 dtypes fails there with one line, not deep inside a training step.
"""

from __future__ import annotations

import math

import torch

from megalite import torch_private
from megalite.errors import ConfigError

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else None
E5M2 = torch.float8_e5m2 if hasattr(torch, "float8_e5m2") else None
# Dense FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_CUDA_CAPABILITY = (8, 9)


def check_available() -> None:
    """Raise ConfigError when this torch cannot run megalite's FP8 GEMMs."""
    if E4M3 is None or E5M2 is None or not hasattr(torch, "_scaled_mm"):
        raise ConfigError(f"fp8.recipe needs torch._scaled_mm and the float8 dtypes, which torch {torch.__version__} "
                          "lacks: install the torch megalite pins (pyproject.toml) or set fp8.recipe=none")


def is_rowwise(scale_a: Tensor, scale_b: Tensor) -> bool:
    """Rowwise when either scale has more than one element (a one-row `a` still has a [1, 1] rowwise scale)."""
    return scale_a.numel() > 1 or scale_b.numel() > 1


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a * scale_a) @ (b * scale_b) in `out_dtype` (see the module doc for the modes and layouts)."""
    rowwise = is_rowwise(scale_a, scale_b)
    if not rowwise:
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    else:
        # Dense strides (a transposed [1, N] scale reads as contiguous to torch but not to _scaled_mm's check).
        scale_a, scale_b = scale_a.flatten().view(-1, 1), scale_b.flatten().view(1, -1)
    if a.is_cuda or torch.compiler.is_compiling():  # inductor's lowering asks CUDA's layouts on every device
        a = a.contiguous()
        b = b.t().contiguous().t()  # column-major
    if a.is_cuda and rowwise and out_dtype != torch.bfloat16:
        y = torch_private.scaled_mm(a, b, scale_a, scale_b, torch.bfloat16)
        return y.to(out_dtype)
    return torch_private.scaled_mm(a, b, scale_a, scale_b, out_dtype)


def pow2_scale(amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(multiplier, dequantiser): 2^k and 2^-k for the largest k with amax * 2^k <= finfo(dtype).max."""
    mf, ef = math.frexp(torch.finfo(dtype).max)
    m, e = torch.frexp(amax.float())
    k = ef - e - (m > mf).to(e.dtype)
    k = torch.where(torch.isfinite(amax) & (amax > 0), k, torch.zeros_like(k)).clamp(-126, 126)
    one = torch.ones_like(amax, dtype=torch.float32)
    return torch.ldexp(one, k), torch.ldexp(one, -k)


def cast_scaled(t: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """t scaled by `pow2_scale(amax)` and cast to `dtype`, and its dequantiser (amax broadcasts against t)."""
    mult, dequant = pow2_scale(amax, dtype)
    return (t.float() * mult).to(dtype), dequant
