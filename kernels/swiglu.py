"""SwiGLU activation silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer").

Forward reads gate and up and writes one output; nothing but the inputs is saved: backward
recomputes sigmoid(gate) instead of storing silu(gate) (one [tokens, ffn] tensor less per layer).
    d/dgate = dy * up * sig * (1 + gate * (1 - sig)),   d/dup = dy * gate * sig.
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import cdiv, jit, tl  # lazy stand-ins (see _triton.py)

BLOCK = 1024  # elements per program: enough loads in flight per SM for an elementwise kernel


@jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (cdiv(n, BLOCK),)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        _swiglu_fwd_kernel[_grid(y.numel())](gate, up, y, y.numel(), BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_bwd_kernel[_grid(dy.numel())](dy, gate, up, dg, du, dy.numel(), BLOCK=BLOCK, num_warps=4)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up have the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return _SwiGLU.apply(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 math, output in the input dtype."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
