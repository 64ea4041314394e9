"""Fused RMSNorm / LayerNorm (+ residual add) vs the fp32 torch references, in the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch

pytest.importorskip("triton")
from megalite.kernels.testing import check_against_reference, use_interpreter  # noqa: E402

K = use_interpreter()

# Tolerances, per input dtype (the reference always runs in fp32 on the same values):
# - fp32: same math, only the order of the row reductions differs: a few ulps (~1e-6) for
#   outputs and gradients of order 1; 1e-5 leaves margin without hiding a wrong formula.
# - bf16: the kernel rounds its fp32 result to bf16 once on store (relative step 2^-8 = 3.9e-3,
#   and the interpreter truncates instead of rounding, so up to 2^-7 = 7.8e-3); the fused add
#   also rounds x + residual to bf16 before normalising, like torch does. 2e-2 covers two such
#   roundings on values of order 1-4.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHAPES = [(2, 8, 64), (1, 37), (5, 3, 37)]  # regular; one row with odd hidden; odd hidden, 15 rows
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(shape))
    H = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)  # non-zero mean: LayerNorm must remove it
    res = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    b = (0.1 * torch.randn(H, generator=g)).to(dtype)
    return x, res, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, _, w, _ = _inputs(shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.rms_norm, K.rms_norm_reference, (x, w, EPS), [0, 1], tol, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, _, w, b = _inputs(shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.layer_norm, K.layer_norm_reference, (x, w, b, EPS), [0, 1, 2], tol, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, res, w, _ = _inputs(shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.add_rms_norm, K.add_rms_norm_reference, (x, res, w, EPS), [0, 1, 2], tol, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, res, w, b = _inputs(shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.add_layer_norm, K.add_layer_norm_reference, (x, res, w, b, EPS), [0, 1, 2, 3], tol, tol)


def test_layer_norm_without_bias() -> None:
    x, _, w, _ = _inputs((4, 37), torch.float32)
    check_against_reference(K.layer_norm, K.layer_norm_reference, (x, w, None, EPS), [0, 1], 1e-5, 1e-5)


def test_add_norm_with_unused_sum() -> None:
    """Only the normalised output used: backward gets no gradient for x + residual."""
    x, res, w, _ = _inputs((6, 37), torch.float32)
    check_against_reference(lambda *a: K.add_rms_norm(*a)[0], lambda *a: K.add_rms_norm_reference(*a)[0],
                            (x, res, w, EPS), [0, 1, 2], 1e-5, 1e-5)


def test_weight_grad_is_deterministic() -> None:
    """dW goes through per-program partial sums, not atomics: two backwards agree bit for bit."""
    x, _, w, b = _inputs((16, 37), torch.float32)
    dy = torch.randn(16, 37)
    grads = []
    for _ in range(2):
        wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
        K.layer_norm(x, wr, br, EPS).backward(dy)
        grads.append((wr.grad, br.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bf16_activations_with_fp32_weights() -> None:
    """Mixed precision: bf16 activations, fp32 master weights; y and dx in bf16, dW in fp32."""
    x, res, w, b = _inputs((3, 5, 37), torch.bfloat16)
    w32, b32 = w.float(), b.float()
    check_against_reference(K.add_layer_norm, K.add_layer_norm_reference, (x, res, w32, b32, EPS), [0, 1, 2, 3],
                            2e-2, 2e-2)
    check_against_reference(K.rms_norm, K.rms_norm_reference, (x, w32, EPS), [0, 1], 2e-2, 2e-2)
