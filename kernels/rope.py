"""Rotary position embedding (Su et al. 2021, "RoFormer") on q and k in one kernel.

Rotate-half convention (Hugging Face Llama): with x1 = x[..., :D/2], x2 = x[..., D/2:],
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin).
One program per token rotates all of its q heads and k heads, so cos/sin are read once per token
instead of once per head. The rotation is orthogonal, so backward is the same kernel with sin
negated (the inverse rotation): nothing is saved but cos and sin.
Outputs are new tensors (q and k may be views of a fused qkv projection that autograd still
needs), so inputs are never overwritten.
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import jit, next_power_of_2, tl  # lazy stand-ins (see _triton.py)


@jit
def _rotate_heads(
    X, Y, cos, sin, b, s, n_heads, D2, stride_xb, stride_xs, stride_xh, stride_yb, stride_ys, stride_yh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < D2)
    x_ptr = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh + cols[None, :]
    y_ptr = Y + b * stride_yb + s * stride_ys + heads[:, None] * stride_yh + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + D2, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + D2, y2.to(Y.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, S, Hq, Hk, D2,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_qob, stride_qos, stride_qoh, stride_kob, stride_kos, stride_koh, stride_cs,
    INVERSE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # int64: batch * stride may pass 2^31 elements
    b = token // S
    s = token % S
    cols = tl.arange(0, BLOCK_D)
    cos = tl.load(COS + s * stride_cs + cols, mask=cols < D2, other=0.0).to(tl.float32)
    sin = tl.load(SIN + s * stride_cs + cols, mask=cols < D2, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    _rotate_heads(Q, QO, cos, sin, b, s, Hq, D2, stride_qb, stride_qs, stride_qh,
                  stride_qob, stride_qos, stride_qoh, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K, KO, cos, sin, b, s, Hk, D2, stride_kb, stride_ks, stride_kh,
                  stride_kob, stride_kos, stride_koh, BLOCK_HK, BLOCK_D)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, S, Hk, D), dtype=k.dtype, device=k.device)
    _rope_kernel[(B * S,)](
        q, k, qo, ko, cos, sin, S, Hq, Hk, D // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), cos.stride(0),
        INVERSE=inverse, BLOCK_HQ=next_power_of_2(Hq), BLOCK_HK=next_power_of_2(Hk),
        BLOCK_D=next_power_of_2(D // 2), num_warps=4 if Hq * D <= 4096 else 8,
    )
    return qo, ko


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        # Both grads are materialised by autograd (zeros if an output was unused).
        assert dq is not None and dk is not None
        dq_in, dk_in = _launch(dq, dk, cos, sin, inverse=True)
        return dq_in, dk_in, None, None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> None:
    B, S, _, D = q.shape
    if D % 2 or k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B,S,H,D] with equal B,S and even D")
    if cos.shape[0] < S or cos.shape[-1] != D // 2:
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)} must be [>= S, D/2] for S={S}, D={D}")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B,S,Hq,D] and k [B,S,Hk,D] by the fp32 angles cos/sin [S,D/2] (rotate-half)."""
    _check(q, k, cos)
    return _Rope.apply(q, k, cos, sin)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch rotate-half RoPE, fp32 math, outputs in the input dtypes."""
    S = q.shape[1]
    c = cos[:S].float()[None, :, None, :]
    s = sin[:S].float()[None, :, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
