"""Ring attention's block math on the Triton flash-attention kernel (Triton interpreter, fp32, tiny shapes).

The Triton block backend must be interchangeable with the torch block math: forward (O, LSE) per block that
`merge_into` combines into the full softmax, and a backward that takes the MERGED statistics (final LSE and
D = rowsum(dO * O)) and returns each block's share of dQ, dK, dV. Checked against autograd through one
materialised softmax over both blocks, then through the whole `ring_attention` and `allgather_attention`
(its mask in global token positions) at cp = 2 against unsplit attention.

Tolerance 2e-5 (absolute and relative), as in tests/test_context_parallel.py: every path computes in fp32
(the interpreter's `tl.dot` is exact fp32, the kernels reorder sums of <= 16 terms and rescale online), the
reference in fp64; observed errors are ~1e-6 on values of order 1, while a wrong mask, a block's own LSE in
place of the merged one or a wrong head mapping gives errors of order 0.1-1.
"""

from __future__ import annotations

import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch

pytest.importorskip("triton")
from megalite.kernels.testing import use_interpreter  # noqa: E402

from megalite.context.group import ContextGroup  # noqa: E402
from megalite.context.zigzag import zigzag_split  # noqa: E402
from megalite.context.blockwise import CAUSAL, block_backward, block_forward, merge_into  # noqa: E402
from tests.test_context_parallel import _problem, _reference, _ring, _run_cp  # noqa: E402

K = use_interpreter()
TOL = dict(atol=2e-5, rtol=2e-5)


def _merged_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, keep: torch.Tensor
                      ) -> list[torch.Tensor]:
    """Grouped q [b, hk, rep, s, d], k/v [b, hk, n, d], mask [s, n]: softmax attention and its gradients by
    autograd, fp64 -> (out, dq, dk, dv)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) / q.shape[-1] ** 0.5
    out = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.unsqueeze(2)
    out.backward(d_out.double())
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("other", ["earlier", "later"])
def test_two_blocks_merge_and_backward_with_global_lse(other: str) -> None:
    """One rank of a cp = 2 ring: its own K/V (causal diagonal block) and the other rank's. "earlier": all
    2c local queries x the other's first key chunk; "later": the last c queries x all 2c of its keys (the
    two off-diagonal shapes of ring.py). GQA 4:2. Forward: the two kernel blocks merged by `merge_into`
    equal one softmax over both; backward: each block's gradients from the merged LSE and D sum to it."""
    b, hk, rep, c, d = 2, 2, 2, 3, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hk * rep, 2 * c, d, generator=g).view(b, hk, rep, 2 * c, d)
    k, v = (torch.randn(b, hk, 4 * c, d, generator=g) for _ in range(2))     # own 2c keys, then the other's 2c
    d_out = torch.randn(b, hk, rep, 2 * c, d, generator=g)
    if other == "earlier":
        rows, keys = slice(0, 2 * c), slice(2 * c, 3 * c)
    else:
        rows, keys = slice(c, 2 * c), slice(2 * c, 4 * c)
    keep = torch.zeros(2 * c, 4 * c, dtype=torch.bool)
    keep[:, : 2 * c] = torch.ones(2 * c, 2 * c, dtype=torch.bool).tril()
    keep[rows, keys] = True
    blocks = [(slice(0, 2 * c), slice(0, 2 * c), CAUSAL), (rows, keys, None)]
    scale = d ** -0.5

    out = lse = None
    for r, kk, mask in blocks:
        blk_out, blk_lse = block_forward(q[:, :, :, r], k[:, :, kk], v[:, :, kk], scale, mask, backend="triton")
        if out is None:
            out, lse = blk_out, blk_lse
        else:
            merge_into(out[:, :, :, r], lse[:, :, :, r], blk_out, blk_lse)
    assert out is not None and lse is not None
    delta = (d_out * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r, kk, mask in blocks:
        dq_blk, dk_blk, dv_blk = block_backward(q[:, :, :, r], k[:, :, kk], v[:, :, kk], d_out[:, :, :, r],
                                                (lse[:, :, :, r], delta[:, :, :, r]), scale, mask, backend="triton")
        dq[:, :, :, r] += dq_blk
        dk[:, :, kk] += dk_blk
        dv[:, :, kk] += dv_blk
    for name, got, want in zip(["out", "dq", "dk", "dv"], [out, dq, dk, dv], _merged_reference(q, k, v, d_out, keep)):
        torch.testing.assert_close(got, want.float(), **TOL, msg=lambda m: f"{name}: {m}")


def test_block_math_refuses_what_it_cannot_do() -> None:
    q, kv = torch.zeros(1, 1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="not a mask tensor"):
        block_forward(q, kv, kv, 1.0, torch.ones(4, 4, dtype=torch.bool), backend="triton")
    with pytest.raises(ValueError, match="backend 'auto'"):
        block_forward(q, kv, kv, 1.0, None, backend="auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mask 'causal!'"):
        block_forward(q, kv, kv, 1.0, "causal!")


def _cp_flash_rank_fn(rank: int, form: str, heads: int, kv_heads: int) -> int:
    """The ring or all-gather form at cp = 2 (one ring of the 2 warm ranks: several rings on 4 ranks run the same
    group code in tests/test_context_parallel.py) with its block math on the Triton kernels, vs unsplit attention:
    output and dq/dk/dv of this rank's zigzag rows. Returns the number of kernel block calls (forward +
    backward) so the caller sees the kernels really ran."""
    use_interpreter()  # this worker may have been started before TRITON_INTERPRET was set
    state = _ring(2)
    q, k, v, d_out = _problem(200 + ContextGroup.of(state).ranks[0], 2, 8, heads, kv_heads, 8)
    launches = []

    def counted(fn):  # noqa: ANN001, ANN202 - a spy with the kernel's signature
        @functools.wraps(fn)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            launches.append(fn.__name__)
            return fn(*args, **kwargs)
        return call

    saved = K.flash_attention_block, K.flash_attention_block_backward
    K.flash_attention_block, K.flash_attention_block_backward = counted(saved[0]), counted(saved[1])
    try:
        got, _, _ = _run_cp(form, q, k, v, d_out, state, backend="triton")
    finally:
        K.flash_attention_block, K.flash_attention_block_backward = saved
    for name, a, want in zip(["out", "dq", "dk", "dv"], got, _reference(q, k, v, d_out)):
        torch.testing.assert_close(a, zigzag_split(want, 2, state.cp_rank).float(), **TOL, msg=lambda m: f"{name}: {m}")
    return len(launches)


@pytest.mark.parametrize("form,calls", [("ring", 4), ("allgather", 2)])
def test_context_parallel_on_triton_blocks_equals_unsplit(dist_world, form: str, calls: int) -> None:
    """The whole ring (forward merge, dK/dV travelling back to their owner; cp = 2 blocks forward and 2
    backward per rank) and the all-gather form (one block each way, masked in global positions) on the
    Triton block backend, grouped-query heads 4:2."""
    assert dist_world(2).run(_cp_flash_rank_fn, form, 4, 2) == [calls] * 2


def _gpt_cp2_triton_rank_fn(rank: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """A tiny GPT at cp = 2 with model.kernels=triton (every op, and each ring block, on the Triton kernels):
    the mean loss over the whole sequence and the gradients of that mean, both reduced over the ring. Also
    returns how many ring blocks ran on the flash kernel, so the caller sees the model chose it."""
    from megalite.data.sampler import cp_split
    from megalite.model.gpt import GPT
    from tests.parallel_utils import layout, tiny_model_cfg

    use_interpreter()
    st = layout(1, cp=2)  # the 2 ranks of dist_world(2) form one ring
    cfg = tiny_model_cfg("llama", kernels="triton", seq_len=8)
    model = GPT(cfg, st, seed=5)
    ids, labels = _gpt_batch(cfg)
    calls = []
    saved = K.flash_attention_block
    K.flash_attention_block = lambda *a, **kw: calls.append(1) or saved(*a, **kw)
    try:
        loss = model(cp_split(ids, 2, st.cp_rank), cp_split(labels, 2, st.cp_rank)).mean()
        loss.backward()
    finally:
        K.flash_attention_block = saved
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=st.group("cp"))
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=st.group("cp"))
        grads[name] = g / 2  # each rank's loss is the mean of its half of the tokens: the mean of the two
    return float(total) / 2, float(len(calls)), grads


def _gpt_batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001 - a config namespace
    """One sequence: the interpreter's cost grows with the rows (the ring's batch: _cp_flash_rank_fn's 2)."""
    data = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    return data[:, :-1], data[:, 1:]


def test_gpt_at_cp2_on_triton_kernels_equals_one_process_on_torch(dist_world) -> None:
    """The model wiring: `model.kernels=triton` at cp = 2 runs the ring's blocks on the flash kernel (2 layers
    x 2 ring steps forward) and gives the single-process torch model's loss and every gradient (same tolerance
    as above: fp32 paths that reorder sums)."""
    from megalite.model.gpt import GPT
    from megalite.parallel.state import ParallelState
    from tests.parallel_utils import tiny_model_cfg

    cfg = tiny_model_cfg("llama", seq_len=8)
    ref = GPT(cfg, ParallelState(), seed=5)
    ids, labels = _gpt_batch(cfg)
    ref_loss = ref(ids, labels).mean()
    ref_loss.backward()
    for loss, calls, grads in dist_world(2).run(_gpt_cp2_triton_rank_fn):
        assert calls == 2 * 2
        assert abs(loss - ref_loss.item()) < 2e-5
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"{name}: {m}")
