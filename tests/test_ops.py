"""The torch backend's RoPE (`model.ops.apply_rope`, a custom autograd function) against autograd over the
rotate-half expression, forward and input gradients, on an odd sequence length and grouped kv heads.

Tolerance: the function computes x1*c - x2*s with a fused multiply-add, the expression with two
rounded products: a few fp32 ulps of O(1) values, so 1e-6. bf16 inputs: both compute in fp32 and
round the result once to bf16, so they agree to one bf16 ulp (2^-7 relative of values up to ~4: 0.05).
"""

from __future__ import annotations

import pytest
import torch

from megalite.model.gpt import rope_tables
from megalite.model.ops import apply_rope


def _expression(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 0.05)])
def test_rope_matches_the_expression(dtype: torch.dtype, atol: float) -> None:
    g = torch.Generator().manual_seed(0)
    b, s, hq, hk, d = 2, 7, 4, 2, 8
    cos, sin = rope_tables(s, d, 10000.0)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype).requires_grad_(True)
    gq, gk = torch.randn(b, s, hq, d, generator=g).to(dtype), torch.randn(b, s, hk, d, generator=g).to(dtype)
    rq, rk = apply_rope(q, k, cos, sin)
    torch.autograd.backward((rq, rk), (gq, gk))
    q2, k2 = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    eq, ek = _expression(q2, cos, sin), _expression(k2, cos, sin)
    torch.autograd.backward((eq, ek), (gq, gk))
    for got, want in [(rq, eq), (rk, ek), (q.grad, q2.grad), (k.grad, k2.grad)]:
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max().item() <= atol
    assert not torch.equal(rq.float(), q.float())  # it rotated something


def _rms_expression(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("shape", [(2, 5, 12), (1, 1, 7)])  # odd hidden, one row
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_rms_norm_matches_the_expression(shape: tuple[int, ...], dtype: torch.dtype, atol: float) -> None:
    """Forward, input gradient and weight gradient under a random upstream gradient. fp32: the same
    math in another order (dw summed over rows, dx from the closed form): ~1e-6 of O(1) values, 1e-5
    allowed. bf16: both compute in fp32 and round once to bf16; dw (fp32 weight) agrees to fp32 round-off."""
    from megalite.model.ops import rms_norm
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_(True)
    w = (torch.rand(shape[-1], generator=g) + 0.5).requires_grad_(True)
    up = torch.randn(shape, generator=g).to(dtype)
    y = rms_norm(x, w, 1e-5)
    y.backward(up)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y2 = _rms_expression(x2, w2, 1e-5)
    y2.backward(up)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == torch.float32
    assert (y.float() - y2.float()).abs().max().item() <= atol
    assert (x.grad.float() - x2.grad.float()).abs().max().item() <= atol
    assert (w.grad - w2.grad).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("fused,plain,has_bias", [("add_rms_norm", "rms_norm", False),
                                                  ("add_layer_norm", "layer_norm", True)])
def test_torch_add_norm_is_the_add_then_the_norm_bitwise(fused: str, plain: str, has_bias: bool) -> None:
    """The torch backend's add + norm is the block's former `x = x + branch; norm(x)`, op for op: output,
    sum and every gradient bitwise equal (so the torch model's numbers did not move when the block started
    calling it)."""
    from megalite.model import ops
    g = torch.Generator().manual_seed(2)
    branch, stream = torch.randn(2, 5, 12, generator=g), torch.randn(2, 5, 12, generator=g)
    weight, bias = torch.rand(12, generator=g) + 0.5, torch.randn(12, generator=g)
    up_y, up_s = torch.randn(2, 5, 12, generator=g), torch.randn(2, 5, 12, generator=g)
    results = []
    for use_fused in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (branch, stream, weight, bias)]
        b, r, w, bb = leaves
        extra = (bb,) if has_bias else ()
        if use_fused:
            y, s = getattr(ops.TORCH_OPS, fused)(b, r, w, *extra, 1e-5)
        else:
            s = r + b
            y = getattr(ops.TORCH_OPS, plain)(s, w, *extra, 1e-5)
        torch.autograd.backward((y, s), (up_y, up_s))
        results.append([y, s] + [t.grad if t.grad is not None else torch.zeros(0) for t in leaves])
    for got, want in zip(*results):
        assert torch.equal(got, want)
