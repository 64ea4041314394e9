"""Every context-parallel mode under every attention variant, with and without documents: each rank's zigzag rows of
the output and of dq, dk, dv equal `reference_attention` over the whole sequence, the ranks' partial d sinks sum
to its d sinks, and the ring's tallied chunk pairs (computed / skipped by the window) equal attention/costs.py.

Tolerance: tests/test_attention_variants.py's 2e-5 (fp32 block math merged online against the fp64 reference)."""

from __future__ import annotations

import pytest
import torch

from megalite.attention.costs import ring_blocks
from tests.test_attention_variants import TOL, VARIANTS, doc_ids, grad, make_variant, problem, reference_grads

SEQ = 16
CASES = [(name, with_docs) for name in ("window", "sinks", "softcap", "all", "window1") for with_docs in (False, True)]


def _rank_fn(rank: int, mode: str, cp: int, a2a: int) -> list[tuple[str, list[float], dict[str, int]]]:
    """Runs every case on this rank; returns per case its d sinks partial and the ring's tallies."""
    from megalite.context.attend import Local, Masking, context_attention
    from megalite.context.documents import DocumentIds
    from megalite.context.options import ContextOptions
    from megalite.context.zigzag import zigzag_split
    from megalite.model.ops import attention
    from tests.parallel_utils import layout

    st = layout(1, cp=cp)
    options = ContextOptions.of(mode, a2a_degree=a2a)
    out_list = []
    for i, (name, with_docs) in enumerate(CASES):
        q, k, v, d_out, sinks = problem(10 + i, seq=SEQ)
        full_docs = doc_ids(2, SEQ) if with_docs else None
        want = reference_grads(q, k, v, d_out, sinks, name, full_docs)
        local = [zigzag_split(t, cp, st.cp_rank).float().requires_grad_() for t in (q, k, v)]
        sf = sinks.float().requires_grad_()
        docs = None if full_docs is None else DocumentIds(zigzag_split(full_docs, cp, st.cp_rank), full_docs)
        st.counter.reset()
        out = context_attention(*local, st, options, Local(lambda *a: attention(*a[:3]), "torch"),
                                Masking(docs, make_variant(name, sf)))
        out.backward(zigzag_split(d_out, cp, st.cp_rank).float())
        for label, a, b in zip(["out", "dq", "dk", "dv"], [out.detach()] + [grad(t) for t in local], want):
            torch.testing.assert_close(a, zigzag_split(b, cp, st.cp_rank).float(), **TOL,
                                       msg=lambda m: f"{mode} cp{cp} {name} docs={with_docs} {label}: {m}")
        out_list.append((f"{name}/{with_docs}", grad(sf).tolist(), st.counter.tallies()))
    return out_list


def _check_sinks_and_blocks(results: list, mode: str, cp: int, a2a: int) -> None:
    for i, (name, with_docs) in enumerate(CASES):
        q, k, v, d_out, sinks = problem(10 + i, seq=SEQ)
        want = reference_grads(q, k, v, d_out, sinks, name, doc_ids(2, SEQ) if with_docs else None)[4]
        got = torch.tensor([r[i][1] for r in results], dtype=torch.float64).sum(0)  # the dp x cp gradient sum
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{mode} {name} docs={with_docs} d sinks: {m}")
        if mode in ("ring", "hybrid"):
            window = VARIANTS[name].get("window")
            ring = cp // a2a
            for rank, r in enumerate(results):
                tallies = r[i][2]
                expected = ring_blocks(SEQ, ring, rank // a2a, window)
                if with_docs:  # documents only skip more
                    assert tallies["cp_blocks_computed"] <= expected.computed
                    assert sum(tallies.values()) == expected.computed + expected.skipped
                else:
                    assert (tallies["cp_blocks_computed"], tallies["cp_blocks_skipped"]) == \
                        (expected.computed, expected.skipped), (name, rank, tallies, expected)
        else:
            assert all(r[i][2] == {} for r in results)


@pytest.mark.parametrize("mode,cp,a2a", [("ring", 2, 1), ("allgather", 2, 1), ("a2a", 2, 2), ("ring", 4, 1),
                                         ("hybrid", 4, 2)])
def test_cp_mode_under_each_variant_equals_the_reference(dist_world, mode: str, cp: int, a2a: int) -> None:
    results = dist_world(cp).run(_rank_fn, mode, cp, a2a)
    _check_sinks_and_blocks(results, mode, cp, a2a)


def test_the_window_skips_ring_blocks() -> None:
    """The count the ring tallies is not vacuous: at cp 2, S 16 (chunks of 4), W 5 skips 3 of the 10 pairs."""
    assert ring_blocks(SEQ, 2, 0, 5).skipped + ring_blocks(SEQ, 2, 1, 5).skipped == 3


def _model_attend_rank_fn(rank: int, mode: str) -> None:
    """megalite/model/attend.py, the block's one call, with a variant under documents: at cp = 2 through the cp
    mode and at cp = 1 (each rank alone: variant_attention) equal to the reference."""
    from megalite.context.attend import Masking
    from megalite.context.documents import DocumentIds
    from megalite.context.options import ContextOptions
    from megalite.context.zigzag import zigzag_split
    from megalite.model.attend import attend
    from megalite.model.ops import TORCH_OPS
    from megalite.parallel.state import ParallelState
    from tests.parallel_utils import layout

    q, k, v, d_out, sinks = problem(40, seq=SEQ)
    full_docs = doc_ids(2, SEQ)
    want = reference_grads(q, k, v, d_out, sinks, "all", full_docs)
    for cp in (1, 2):
        st = layout(1, cp=2) if cp == 2 else ParallelState()
        cp_rank = st.cp_rank if cp == 2 else 0
        lq, lk, lv = local = [zigzag_split(t, cp, cp_rank).float().requires_grad_() for t in (q, k, v)]
        docs = DocumentIds(zigzag_split(full_docs, cp, cp_rank), full_docs)
        sf = sinks.float().requires_grad_()
        out = attend(lq, lk, lv, Masking(docs, make_variant("all", sf)), st, ContextOptions.of(mode), TORCH_OPS,
                     lambda fn, *a: fn(*a))
        out.backward(zigzag_split(d_out, cp, cp_rank).float())
        for label, a, b in zip(["out", "dq", "dk", "dv"], [out.detach()] + [grad(t) for t in local], want):
            torch.testing.assert_close(a, zigzag_split(b, cp, cp_rank).float(), **TOL,
                                       msg=lambda m: f"cp{cp} {label}: {m}")
        if cp == 1:
            torch.testing.assert_close(grad(sf), want[4].float(), **TOL)


@pytest.mark.parametrize("mode", ["ring", "a2a"])
def test_the_blocks_one_call_carries_the_variant(dist_world, mode: str) -> None:
    dist_world(2).run(_model_attend_rank_fn, mode)
