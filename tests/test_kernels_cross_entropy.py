"""Cross-entropy kernels (single and vocab-parallel) vs fp32 torch, in the Triton interpreter.

The vocab-parallel kernel is also run for real across 2 gloo processes, each holding half of a
prime vocabulary, and compared with the single-process loss and gradient.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")
from megalite.kernels.testing import check_against_reference, use_interpreter  # noqa: E402

K = use_interpreter()

# Tolerances, per logits dtype (the reference is F.cross_entropy on fp32 copies of the logits):
# - fp32: both accumulate in fp32; only the order of the V-long sums and the online rescaling
#   differ: ~1e-6 on losses of order 5; 1e-5 absolute and relative.
# - bf16: the loss is still accumulated in fp32 from the same bf16 values, so it stays at 1e-5.
#   The gradient is stored in bf16 (relative step 2^-8, 2^-7 with the interpreter's truncation)
#   and rounded a second time when backward scales it by grad_output: 2e-2 covers both.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
# (rows, vocab): 131 is prime and spans 3 interpreter blocks of 64; one row; a power of two
SHAPES = [(16, 131), (1, 131), (5, 64)]
IGNORE = -100
VOCAB, SPLIT = 131, 66  # 2-shard simulation: rank 0 holds 66 columns, rank 1 holds 65


def _problem(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + n * v)
    logits = (3 * torch.randn(n, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[1::3] = IGNORE  # every third row from the second one is padding
    return logits, target


def _identity(_: torch.Tensor) -> None:
    """All-reduce over a group of one."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cross_entropy(shape: tuple[int, int], dtype: torch.dtype) -> None:
    logits, target = _problem(*shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.cross_entropy, K.cross_entropy_reference, (logits, target, IGNORE), [0],
                            tol, tol, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_parallel_with_identity_equals_cross_entropy(dtype: torch.dtype) -> None:
    logits, target = _problem(16, 131, dtype)
    go = torch.randn(16)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss_a = K.cross_entropy(a, target, IGNORE)
    loss_b = K.vocab_parallel_cross_entropy(b, target, 0, _identity, _identity, IGNORE)
    loss_a.backward(go)
    loss_b.backward(go)
    # Same statistics and the same gradient kernel; the loss is finished by torch.log instead of
    # tl.log, which may differ by an ulp: 1e-6 on losses of order 5.
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert torch.equal(a.grad, b.grad)
    check_against_reference(
        lambda x, t: K.vocab_parallel_cross_entropy(x, t, 0, _identity, _identity, IGNORE),
        lambda x, t: K.vocab_parallel_cross_entropy_reference(x, t, 0, _identity, _identity, IGNORE),
        (logits, target), [0], TOL[dtype], TOL[dtype], out_dtype=torch.float32)


def test_custom_ignore_index_and_all_ignored() -> None:
    logits, target = _problem(6, 37, torch.float32)
    target[target == IGNORE] = 3
    target[:3] = 7  # 7 is a real vocab id, used here as the ignore index
    check_against_reference(lambda x, t: K.cross_entropy(x, t, 7), lambda x, t: K.cross_entropy_reference(x, t, 7),
                            (logits, target), [0], 1e-5, 1e-5, out_dtype=torch.float32)
    x = logits.clone().requires_grad_()
    loss = K.cross_entropy(x, torch.full((6,), IGNORE), IGNORE)
    loss.backward(torch.ones(6))
    assert torch.equal(loss, torch.zeros(6)) and torch.equal(x.grad, torch.zeros_like(x))


def test_logits_untouched_without_grad_and_consumed_with_grad() -> None:
    logits, target = _problem(4, 37, torch.float32)
    kept = logits.clone()
    K.cross_entropy(logits, target)
    assert torch.equal(logits, kept), "no gradient wanted: the logits must not be overwritten"
    # With a gradient the logits buffer is reused for it; autograd must notice if another op saved
    # the logits (tanh saves its output), instead of silently back-propagating garbage.
    x = logits.clone().requires_grad_()
    capped = torch.tanh(x)
    with pytest.raises(RuntimeError, match="inplace"):
        K.cross_entropy(capped, target).sum().backward()


def _vp_rank(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One of the 2 warm gloo ranks (tests/dist_harness.py): half of the vocabulary, its loss and gradient."""
    kernels = use_interpreter()
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for dtype in DTYPES:
        logits, target = _problem(16, VOCAB, dtype)
        go = torch.randn(16, generator=torch.Generator().manual_seed(1))
        for name in ("kernel", "reference"):
            fn = getattr(kernels, "vocab_parallel_cross_entropy" + ("_reference" if name == "reference" else ""))
            shard = logits[:, lo:hi].clone().requires_grad_()
            loss = fn(shard, target, lo, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),
                      lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM), IGNORE)
            loss.backward(go)
            results[f"{dtype}-{name}"] = (loss.detach().clone(), shard.grad.clone())
    return results


def test_vocab_parallel_two_shards_match_single_process(dist_world) -> None:
    ranks = dist_world(2).run(_vp_rank)
    for dtype in DTYPES:
        logits, target = _problem(16, VOCAB, dtype)
        go = torch.randn(16, generator=torch.Generator().manual_seed(1))
        x = logits.float().requires_grad_()
        ref_loss = K.cross_entropy_reference(x, target, IGNORE)
        ref_loss.backward(go)
        for name in ("kernel", "reference"):
            (loss0, grad0), (loss1, grad1) = (r[f"{dtype}-{name}"] for r in ranks)
            assert grad0.dtype == dtype and grad0.shape == (16, SPLIT) and grad1.shape == (16, VOCAB - SPLIT)
            # Both ranks finish with the same all-reduced statistics, so they agree exactly.
            assert torch.equal(loss0, loss1)
            # Loss: fp32 statistics, the sum over 131 columns split in two partial sums: 1e-5.
            torch.testing.assert_close(loss0, ref_loss.detach(), atol=1e-5, rtol=1e-5)
            grad = torch.cat([grad0, grad1], dim=1).float()
            torch.testing.assert_close(grad, x.grad, atol=TOL[dtype], rtol=TOL[dtype])
