"""RoPE, SwiGLU and tanh-GeLU kernels vs the fp32 torch references, in the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch

pytest.importorskip("triton")
from megalite.kernels.testing import check_against_reference, use_interpreter  # noqa: E402

K = use_interpreter()

# Tolerances, per input dtype (the reference runs in fp32 on the same values):
# - fp32: elementwise formulas evaluated in fp32 in both; they differ only in how sigmoid / tanh /
#   exp are computed (a few ulps): 1e-5 absolute and relative.
# - bf16: the kernel computes in fp32 and rounds once to bf16 on store: relative error 2^-8, up to
#   2^-7 because the interpreter truncates; 2e-2 covers that with margin on values of order 1-10.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
ELEMENTWISE_SHAPES = [(4, 64), (1, 37), (3, 5, 37)]
# (B, S, Hq, Hk, D): regular; one token; an odd-length sequence with grouped-query heads. The kernel runs one
# program per token (the whole row of heads in it), so no length is special; each token costs an interpreted
# program (suite time): 13 tokens.
ROPE_SHAPES = [(2, 8, 4, 4, 16), (1, 1, 1, 1, 16), (1, 13, 4, 2, 16)]


def _angles(S: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rope(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    B, S, Hq, Hk, D = shape
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    cos, sin = _angles(S, D)
    tol = TOL[dtype]
    check_against_reference(K.apply_rope, K.apply_rope_reference, (q, k, cos, sin), [0, 1], tol, tol)


def test_rope_strided_views_of_fused_qkv() -> None:
    """q and k as slices of one fused projection (non-contiguous heads) give the same result."""
    B, S, Hq, Hk, D = 2, 7, 4, 2, 16
    qkv = torch.randn(B, S, Hq + 2 * Hk, D)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    cos, sin = _angles(S, D)
    check_against_reference(K.apply_rope, K.apply_rope_reference, (q, k, cos, sin), [0, 1], 1e-5, 1e-5)


def test_rope_matches_hugging_face_rotate_half() -> None:
    """The convention itself: out = x * cos + rotate_half(x) * sin with full-width cos/sin."""
    q = torch.randn(1, 5, 2, 16)
    cos, sin = _angles(5, 16)
    c, s = torch.cat((cos, cos), -1)[None, :, None], torch.cat((sin, sin), -1)[None, :, None]
    x1, x2 = q.chunk(2, -1)
    expected = q * c + torch.cat((-x2, x1), -1) * s
    torch.testing.assert_close(K.apply_rope(q, q[:, :, :1], cos, sin)[0], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(shape))
    gate = (3 * torch.randn(shape, generator=g)).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    tol = TOL[dtype]
    check_against_reference(K.swiglu, K.swiglu_reference, (gate, up), [0, 1], tol, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
def test_gelu_tanh(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(shape))
    x = (4 * torch.randn(shape, generator=g)).to(dtype)  # reaches the saturated tails of tanh
    tol = TOL[dtype]
    check_against_reference(K.gelu_tanh, K.gelu_tanh_reference, (x,), [0], tol, tol)


def test_gelu_tanh_extremes() -> None:
    """Very large |x|: no inf/nan from exp overflow inside the tanh."""
    x = torch.tensor([-1e4, -50.0, -10.0, 0.0, 10.0, 50.0, 1e4])
    check_against_reference(K.gelu_tanh, K.gelu_tanh_reference, (x,), [0], 1e-5, 1e-5)
