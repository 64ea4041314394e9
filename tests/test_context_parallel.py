"""Context parallelism (megalite/context): the zigzag split, ring attention and the all-gather-K/V form
against unsplit causal attention, and the bytes they move against the closed forms.

Tolerances: the parallel forms compute in fp32 and merge per-block softmaxes (online softmax), so they
differ from the reference (computed in fp64, then compared) only by fp32 rounding, accumulated over at most
a few dozen keys and cp merges: observed up to 1.2e-6 (absolute, on values of order 1-10). 2e-5 (absolute
and relative) leaves margin for other BLAS builds, while a masking, merge or ring-order mistake shows up as
errors of order 0.1-1 (checked by breaking the mask and the dK/dV return on purpose).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megalite.context.allgather import allgather_attention
from megalite.context.costs import allgather_attention_bytes, ring_attention_bytes
from megalite.context.group import ContextGroup
from megalite.context.ring import ring_attention
from megalite.context.zigzag import check_zigzag, zigzag_merge, zigzag_positions, zigzag_split
from megalite.errors import ConfigError
from megalite.model.gpt import rope_tables
from megalite.model.ops import apply_rope, attention
from megalite.parallel.state import ParallelState

TOL = dict(atol=2e-5, rtol=2e-5)
FORMS = {"ring": (ring_attention, ring_attention_bytes), "allgather": (allgather_attention, allgather_attention_bytes)}


# ---------------------------------------------------------------- the split (no processes)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_round_trips_and_positions_match(cp: int) -> None:
    seq = 2 * cp * 3
    x = torch.arange(2 * seq * 5).reshape(2, seq, 5)
    parts = [zigzag_split(x, cp, r) for r in range(cp)]
    assert torch.equal(zigzag_merge(parts), x)
    for r, part in enumerate(parts):
        pos = zigzag_positions(seq, cp, r)
        assert torch.equal(part, x[:, pos])                              # the positions name the tokens held
        assert torch.equal(pos, pos.sort().values)                       # local tokens in position order
    assert sorted(torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)]).tolist()) == list(range(seq))


def test_zigzag_balances_causal_work() -> None:
    """Every rank's queries see the same number of keys under the causal mask (a contiguous split does not)."""
    seq, cp = 32, 4
    work = [int((zigzag_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1 and sum(work) == seq * (seq + 1) // 2
    contiguous = [int((torch.arange(r * seq // cp, (r + 1) * seq // cp) + 1).sum()) for r in range(cp)]
    assert len(set(contiguous)) == cp


def test_zigzag_rejects_indivisible_sequence() -> None:
    with pytest.raises(ConfigError, match="not divisible by 2\\*cp = 8"):
        check_zigzag(36, 4)
    with pytest.raises(ConfigError):
        zigzag_split(torch.zeros(1, 6, 2), 2, 0)


@pytest.mark.parametrize("form", list(FORMS))
def test_attention_rejects_bad_shapes(form: str) -> None:
    fn = FORMS[form][0]
    with pytest.raises(ConfigError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        fn(torch.zeros(1, 4, 6, 8), torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 4, 8), ParallelState())
    with pytest.raises(ValueError):
        fn(torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), ParallelState())


def test_rope_at_zigzag_positions_equals_rope_then_split() -> None:
    torch.manual_seed(0)
    seq, cp, heads, kv_heads, d = 24, 4, 4, 2, 8
    cos, sin = rope_tables(seq, d, 10000.0)
    q, k = torch.randn(2, seq, heads, d), torch.randn(2, seq, kv_heads, d)
    q_full, k_full = apply_rope(q, k, cos, sin)
    for r in range(cp):
        pos = zigzag_positions(seq, cp, r)
        q_r, k_r = apply_rope(zigzag_split(q, cp, r), zigzag_split(k, cp, r), cos[pos], sin[pos])
        assert torch.equal(q_r, zigzag_split(q_full, cp, r)) and torch.equal(k_r, zigzag_split(k_full, cp, r))


def test_context_group_rank_order() -> None:
    """tp fastest, then cp, dp, pp; at cp = 1 each rank is its own ring (today's layouts unchanged)."""
    assert ParallelState(tp=2, cp=2, pp=1, dp=2).group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ParallelState(tp=1, cp=4, pp=2, dp=1).group_ranks("cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ParallelState(tp=2, cp=1, pp=2, dp=2).group_ranks("cp") == [[r] for r in range(8)]


# ---------------------------------------------------------------- attention vs the unsplit reference
def _problem(seed: int, batch: int, seq: int, heads: int, kv_heads: int, d: int) -> list[torch.Tensor]:
    """q, k, v and an upstream gradient (random, so every output element weighs differently), fp64."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq, heads, d), (batch, seq, kv_heads, d), (batch, seq, kv_heads, d), (batch, seq, heads, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor) -> list[torch.Tensor]:
    """Unsplit causal attention (SDPA, megalite's model path) in fp64: output, dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _run_cp(form: str, q, k, v, d_out, st: ParallelState, dtype: torch.dtype = torch.float32,
            backend: str = "torch") -> tuple[list[torch.Tensor], Fraction, Fraction]:
    """This rank's output and input gradients (zigzag-local) and the cp bytes of forward, backward."""
    fn = FORMS[form][0]
    local = [zigzag_split(t, st.cp, st.cp_rank).to(dtype) for t in (q, k, v)]
    for t in local:
        t.requires_grad_()
    out = fn(*local, st, backend=backend)
    fwd = st.counter.exact_bytes("cp")
    out.backward(zigzag_split(d_out, st.cp, st.cp_rank).to(dtype))
    return [out.detach()] + [t.grad for t in local], fwd, st.counter.exact_bytes("cp") - fwd


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (3, 3), (4, 1)])
def test_single_rank_equals_causal_attention(form: str, heads: int, kv_heads: int) -> None:
    """cp = 1 (no process group): the block attention and its hand-written backward alone."""
    q, k, v, d_out = _problem(1, 3, 10, heads, kv_heads, 8)
    got, fwd, bwd = _run_cp(form, q, k, v, d_out, ParallelState())
    for a, b in zip(got, _reference(q, k, v, d_out)):
        torch.testing.assert_close(a, b.float(), **TOL)
    assert fwd == bwd == 0


def _ring(cp: int, tp: int = 1) -> ParallelState:
    """This rank's ParallelState in a tp x cp x dp world (4 ranks), with a fresh counter."""
    from tests.parallel_utils import layout

    return layout(tp, cp=cp)


def _cp_rank_fn(rank: int, form: str, cp: int, heads: int, kv_heads: int,
                dtype: torch.dtype = torch.float32, tp: int = 1) -> tuple[float, float]:
    st = _ring(cp, tp)
    batch, seq, d = 3, 2 * cp * 3, 8
    q, k, v, d_out = _problem(100 + ContextGroup.of(st).ranks[0], batch, seq, heads, kv_heads, d)  # one per ring
    # bf16: the reference takes the same rounded inputs; the parallel forms compute in fp32 and round once
    # at the end (outputs, and dK/dV after their fp32 sum over the ring): within a few bf16 ulps (2^-8).
    q, k, v, d_out = (t.to(dtype).double() for t in (q, k, v, d_out))
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    got, fwd, bwd = _run_cp(form, q, k, v, d_out, st, dtype)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, _reference(q, k, v, d_out)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), zigzag_split(b, cp, st.cp_rank).float(), **tol,
                                   msg=lambda m: f"{name}: {m}")
    expected = FORMS[form][1](batch, seq, kv_heads, d, cp, elem_bytes=torch.finfo(dtype).bits // 8)
    assert (fwd, bwd) == (expected.forward, expected.backward), (fwd, bwd, expected)
    return float(fwd), float(bwd)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (3, 3)])
def test_context_parallel_attention_equals_unsplit(dist_world, form: str, cp: int, tp: int, heads: int,
                                                   kv_heads: int) -> None:
    """4 ranks: two rings of 2 (ranks [0, 1], [2, 3]; or [0, 2], [1, 3] beside tp = 2), each with its own
    problem, or one ring of 4. Output and dq/dk/dv of every rank equal the zigzag split of the unsplit
    attention's; the cp bytes equal the closed form on every rank."""
    results = dist_world(4).run(_cp_rank_fn, form, cp, heads, kv_heads, torch.float32, tp)
    assert len(set(results)) == 1 and results[0][0] > 0


@pytest.mark.parametrize("form", list(FORMS))
def test_bf16_inputs_and_bytes(dist_world, form: str) -> None:
    """bf16 K/V travel in bf16 (2 bytes), gradient partials in fp32: the closed form with e = 2."""
    results = dist_world(4).run(_cp_rank_fn, form, 2, 6, 2, torch.bfloat16)
    assert len(set(results)) == 1 and results[0][0] > 0


def _overlap_rank_fn(rank: int, cp: int) -> list[int]:
    """The number of K/V sends this rank had posted when each forward block started computing."""
    from megalite.context import ring

    st, seen = _ring(cp), []
    compute = ring.block_forward

    def spy(*args, **kwargs):
        seen.append(st.counter.calls().get("cp", 0))
        return compute(*args, **kwargs)

    q, k, v, _ = _problem(7, 1, 2 * cp, 2, 1, 4)
    ring.block_forward = spy
    try:
        ring_attention(*(zigzag_split(t, cp, st.cp_rank).float() for t in (q, k, v)), st)
    finally:
        ring.block_forward = compute
    return seen


def test_ring_posts_next_transfer_before_computing(dist_world) -> None:
    """Overlap by construction (not by timing): block i computes after the transfer of block i+1 was posted."""
    assert dist_world(4).run(_overlap_rank_fn, 4) == [[1, 2, 3, 3]] * 4
