"""Fused RMSNorm / LayerNorm, optionally fused with the residual add, forward and backward.

One Triton kernel pair serves both norms (`IS_RMS`) with and without bias and residual:
- forward reads x (and the residual), writes y (and s = x + residual) and one fp32 rstd (and mean,
  for LayerNorm) per row: that is all backward needs besides x and the weight;
- backward recomputes x_hat from x and rstd, writes dx, and reduces dW/db per program into a
  [programs, H] fp32 buffer that torch sums afterwards: deterministic, unlike atomics.
RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization". LayerNorm: Ba et al. 2016.
All math is fp32 whatever the storage dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import cdiv, jit, num_row_programs, row_blocks, tl  # lazy stand-ins (see _triton.py)


@jit
def _norm_fwd_kernel(
    X, R, S, Y, W, B, MEAN, RSTD,
    n_rows, H, stride_x, stride_r, stride_s, stride_y, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride > 2^31
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < n_rows
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], s, mask=mask)
        # Normalise the stored (rounded) sum, so backward, which re-reads it, sees the same input.
        x = s.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / H
        tl.store(MEAN + rows, mean, mask=row_mask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / H + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _norm_bwd_kernel(
    DY, DS, X, W, MEAN, RSTD, DX, DW_PART, DB_PART,
    n_rows, H, rows_per_program, stride_dy, stride_ds, stride_x, stride_dx,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for offset in range(0, rows_per_program, BLOCK_M):
        rows = first_row + offset + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            x_hat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        # d/dx of (x_hat * w): rstd * (g - mean(g) - x_hat * mean(g * x_hat)); RMSNorm has no mean(g).
        c1 = tl.sum(g * x_hat, axis=1) / H
        if IS_RMS:
            dx = (g - x_hat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / H
            dx = (g - c2[:, None] - x_hat * c1[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * H + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * H + cols, tl.sum(db_acc, axis=0), mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, H] with unit column stride (copies only if the input is oddly strided)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _FusedNorm(torch.autograd.Function):
    """(x, residual?, weight, bias?) -> (y, s?) with s = x + residual; see module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
        bias: torch.Tensor | None, eps: float, is_rms: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        H = x.shape[-1]
        x2 = _rows(x)
        n = x2.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        has_res = residual is not None
        r2 = _rows(residual) if residual is not None else x2
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_res else x
        s2 = s.view(n, H) if has_res else x2  # the norm's input, re-read by backward
        mean = torch.empty(n, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block_m, block_h, warps = row_blocks(H, n)
        _norm_fwd_kernel[(cdiv(n, block_m),)](
            x2, r2, s2, y, weight, bias if bias is not None else weight, mean, rstd,
            n, H, x2.stride(0), r2.stride(0), s2.stride(0), H, eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=has_res,
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps,
        )
        ctx.save_for_backward(s2, weight, bias, mean, rstd)
        ctx.meta = (x.shape, is_rms, has_res)
        return (y, s) if has_res else y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        s, weight, bias, mean, rstd = ctx.saved_tensors
        shape, is_rms, has_res = ctx.meta
        n, H = s.shape
        dy, ds = grads[0], (grads[1] if has_res else None)
        assert dy is not None
        dy2 = _rows(dy)
        has_ds = ds is not None
        ds2 = _rows(ds) if ds is not None else dy2
        dx = torch.empty(shape, dtype=s.dtype, device=s.device)
        block_m, block_h, warps = row_blocks(H, n)
        programs = num_row_programs(cdiv(n, block_m), s.device)
        rows_per_program = cdiv(cdiv(n, programs), block_m) * block_m
        programs = cdiv(n, rows_per_program)
        dw_part = torch.empty((programs, H), dtype=torch.float32, device=s.device)
        db_part = torch.empty((programs, H), dtype=torch.float32, device=s.device) if bias is not None else dw_part
        _norm_bwd_kernel[(programs,)](
            dy2, ds2, s, weight, mean, rstd, dx, dw_part, db_part,
            n, H, rows_per_program, dy2.stride(0), ds2.stride(0), s.stride(0), H,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_DS=has_ds,
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps,
        )
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, (dx if has_res else None), dw, db, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dim, fp32 math, output in x.dtype."""
    return _FusedNorm.apply(x, None, weight, None, eps, True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = (x - mean) * rsqrt(var + eps) * weight + bias over the last dim (biased variance)."""
    return _FusedNorm.apply(x, None, weight, bias, eps, False)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass: the pre-norm block's residual stream."""
    return _FusedNorm.apply(x, residual, weight, None, eps, True)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual) in one pass."""
    return _FusedNorm.apply(x, residual, weight, bias, eps, False)


# ---- plain-torch references (fp32 math, output in the input dtype) ----

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    b = bias.float() if bias is not None else None
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps)
    return y.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


def add_layer_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return layer_norm_reference(s, weight, bias, eps), s
