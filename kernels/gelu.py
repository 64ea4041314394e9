"""GeLU, tanh approximation (Hendrycks & Gimpel 2016), as F.gelu(x, approximate="tanh").

    y = 0.5 x (1 + tanh(z)),  z = sqrt(2/pi) (x + 0.044715 x^3)
    dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(z)
Backward recomputes t from x: only x is saved. tanh is written through exp so that it runs the
same in the interpreter and on every GPU backend: tanh(z) = 1 - 2 / (exp(2z) + 1), which
is accurate to a few fp32 ulps once |z| is clamped to 15 (where tanh is already +-1 in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import cdiv, jit, tl  # lazy stand-ins (see _triton.py)

BLOCK = 1024


@jit
def _tanh(z):
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh(15) == 1 in fp32; avoids exp overflow
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@jit
def _gelu_fwd_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(Y + offs, (0.5 * x * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)


@jit
def _gelu_bwd_kernel(DY, X, DX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    dx = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dz)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        y = torch.empty_like(x)
        _gelu_fwd_kernel[(cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        _gelu_bwd_kernel[(cdiv(x.numel(), BLOCK),)](dy, x, dx, x.numel(), BLOCK=BLOCK, num_warps=4)
        return dx


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation, elementwise, output in x.dtype."""
    return _GeluTanh.apply(x)


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 math, output in the input dtype."""
    return torch.nn.functional.gelu(x.float(), approximate="tanh").to(x.dtype)
