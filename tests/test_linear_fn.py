"""`layers.linear_fn`: per-part matmuls and the main-grad fold, against F.linear on the whole weight.

Tolerances: fp32 — the same dot products, but a BLAS call on a row block of the weight may block the
K loop differently from one call on the whole weight: differences of a few fp32 ulps of O(1-10)
values, so 1e-5 absolute. bf16 — inputs, weight and upstream gradient are bf16 and both sides round
each output to bf16 (8 bits of mantissa): a relative 2^-8 of values up to ~10, so 0.1 absolute; the
fold's bf16 accumulation is compared bit for bit against the hook path's arithmetic it replaces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.dp.grad_sync import FoldsWeightGrad
from megalite.layers.linear_fn import linear, linear_parts, part_blocks
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.parallel.state import ParallelState
from tests.parallel_utils import ADAMW, tiny_model_cfg

SIZES = [(7,), (6, 3, 3), (5, 5)]


def _inputs(sizes: tuple[int, ...], bias: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(2, 3, 9, generator=g).to(dtype).requires_grad_(True)  # 3-D: batch, seq, odd hidden
    w = torch.randn(sum(sizes), 9, generator=g).to(dtype).requires_grad_(True)
    b = torch.randn(sum(sizes), generator=g).to(dtype).requires_grad_(True) if bias else None
    ups = [torch.randn(2, 3, n, generator=g).to(dtype) for n in sizes]
    return x, w, b, ups


def _reference(x, w, b, ups):
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    br = None if b is None else b.detach().clone().requires_grad_(True)
    y = F.linear(xr, wr, br)
    outs = y.split([u.shape[-1] for u in ups], dim=-1)
    torch.autograd.backward(outs, ups)
    return outs, xr.grad, wr.grad, None if br is None else br.grad


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("sizes", SIZES)
def test_parts_match_f_linear(sizes: tuple[int, ...], bias: bool, dtype: torch.dtype, atol: float) -> None:
    x, w, b, ups = _inputs(sizes, bias, dtype)
    outs = linear_parts(x, w, b, part_blocks(sizes))
    ref_outs, gx, gw, gb = _reference(x, w, b, ups)
    assert len(outs) == len(sizes)
    for o, r in zip(outs, ref_outs):
        assert o.is_contiguous() and o.dtype == dtype  # each part its own buffer
        assert (o.float() - r.float()).abs().max().item() <= atol
    torch.autograd.backward(outs, ups)
    for got, want, what in [(x.grad, gx, "input"), (w.grad, gw, "weight"), (None if b is None else b.grad, gb, "bias")]:
        if want is None:
            continue
        assert got.dtype == want.dtype, what
        assert (got.float() - want.float()).abs().max().item() <= atol, what


def test_weight_in_another_dtype_gets_its_own_dtype_gradient() -> None:
    x, w, _, ups = _inputs((4,), False, torch.float32)
    y = linear(x.detach().bfloat16().requires_grad_(True), w)  # fp32 weight, bf16 activations
    assert y.dtype == torch.bfloat16
    y.backward(ups[0].bfloat16())
    assert w.grad is not None and w.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_accumulates_into_main_grad_and_leaves_no_grad(dtype: torch.dtype) -> None:
    sizes = (6, 3, 3)
    x, w, _, ups = _inputs(sizes, False, dtype)
    main = torch.zeros(w.shape, dtype=torch.float32)
    calls = []

    def fold(accumulate) -> None:
        calls.append(1)
        accumulate(main)

    for _ in range(2):  # two micro-batches accumulate
        torch.autograd.backward(linear_parts(x, w, None, part_blocks(sizes), fold), ups)
    assert w.grad is None and len(calls) == 2
    x2 = x.detach().reshape(-1, 9)
    blocks = [torch.mm(u.reshape(-1, u.shape[-1]).t(), x2) for u in ups]  # dW per part, in `dtype`
    once = torch.cat(blocks).float()
    want = once + once  # the hook path: main += dW (rounded to `dtype`), twice
    if dtype == torch.float32:  # addmm_ accumulates inside the GEMM: a different rounding order
        assert (main - want).abs().max().item() <= 1e-5
    else:
        assert torch.equal(main, want)
    _, gx, _, _ = _reference(x, w, None, ups)
    assert (x.grad.float() / 2 - gx.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.1)


def test_fold_survives_activation_checkpointing() -> None:
    """Full recompute hands backward a recomputed alias of the weight: the fold must still be used."""
    x, w, _, ups = _inputs((4,), False, torch.float32)
    main = torch.zeros(w.shape)
    y = checkpoint(lambda t: torch.tanh(linear(t, w, fold=lambda accumulate: accumulate(main))), x,
                   use_reentrant=False)
    y.backward(ups[0])
    assert w.grad is None
    w2 = w.detach().clone().requires_grad_(True)
    torch.tanh(F.linear(x.detach(), w2)).backward(ups[0])
    assert (main - w2.grad).abs().max().item() <= 1e-5


def test_zero_optimizer_refuses_a_grad_that_skipped_the_fold() -> None:
    st = ParallelState()
    model = GPT(tiny_model_cfg("llama"), st, seed=1)
    build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
    w = model.layers["0"].mlp.down.weight
    with pytest.raises(RuntimeError, match="got a .grad"):
        (F.linear(torch.randn(2, w.shape[1]), w).sum()).backward()  # plain F.linear: no fold


def test_bad_part_sizes_are_refused() -> None:
    x, w, _, _ = _inputs((7,), False, torch.float32)
    with pytest.raises(ValueError, match="do not cover"):
        linear_parts(x, w, None, part_blocks((3, 3)))


def test_zero_optimizer_folds_only_weights_of_one_linear() -> None:
    """A tied embedding/head weight has two users: it keeps the `.grad` + hook path."""
    st = ParallelState()
    for arch in ("llama", "gpt2"):
        model = GPT(tiny_model_cfg(arch), st, seed=1)
        build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
        folded = {f"{n}.weight" for n, m in model.named_modules()
                  if isinstance(m, FoldsWeightGrad) and m.wgrad_fold is not None}
        linears = {n for n, _ in model.named_parameters()
                   if n.endswith(("qkv.weight", "out.weight", "up.weight", "down.weight"))}
        tied = arch == "gpt2"
        assert folded == linears | (set() if tied else {"head.weight"}), arch
