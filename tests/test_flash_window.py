"""The Triton flash kernels under the attention variants (Triton interpreter, fp32, tiny shapes): the whole-sequence
kernel against `reference_attention` (forward, dq, dk, dv, d sinks; with documents too), the tiles it visits
against attention/costs.py's bounds (a window makes them linear in the sequence), the block kernels (window in
global positions, soft-cap, document segment ids) against the torch block math, and the ring / all-gather forms
at cp = 2 on the Triton blocks against the reference, with documents too.

Tolerance 2e-5 as tests/test_context_flash.py: the interpreter's tl.dot is exact fp32, the kernels reorder sums
of <= 16 terms and rescale online; the references are fp64. A window bound off by one tile, a missing
1 - tanh^2 or a sink left out of the LSE give errors of order 1e-2-1."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch

pytest.importorskip("triton")
from megalite.kernels import testing  # noqa: E402

from megalite.attention.blocks import PositionMask, Scores, block_backward, block_forward  # noqa: E402
from megalite.attention.costs import flash_dkdv_tiles, flash_forward_tiles  # noqa: E402
from tests.test_attention_variants import (TOL, doc_ids, grad, make_variant, problem,  # noqa: E402
                                           reference_grads)

K = testing.use_interpreter()
SEQ = 24  # 2 tiles of 16 under the interpreter, the last one partial


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, sinks: torch.Tensor, name: str,
           docs: torch.Tensor | None, tiles: torch.Tensor | None = None) -> list[torch.Tensor]:
    qf, kf, vf, sf = (t.float().requires_grad_() for t in (q, k, v, sinks))
    var = make_variant(name, sf)
    out = K.flash_attention(qf, kf, vf, True, var.softmax_scale(q.shape[-1]), docs, window=var.window,
                            softcap=var.softcap, sinks=var.sinks, tiles=tiles)
    out.backward(d_out.float())
    return [out.detach(), grad(qf), grad(kf), grad(vf), grad(sf)]


@pytest.mark.parametrize("name,with_docs", [("window", False), ("window1", False), ("sinks", False),
                                            ("softcap", False), ("all", False), ("window", True), ("all", True)])
def test_flash_attention_under_a_variant_equals_the_reference(name: str, with_docs: bool) -> None:
    """GQA 2:1, one sequence (the interpreter's time is per program)."""
    q, k, v, d_out, sinks = problem(5, batch=1, seq=SEQ, heads=2, kv_heads=1)
    docs = doc_ids(1, SEQ) if with_docs else None
    got = _flash(q, k, v, d_out, sinks, name, docs)
    for label, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got,
                           reference_grads(q, k, v, d_out, sinks, name, docs)):
        torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m: f"{name} docs={with_docs} {label}: {m}")


@pytest.mark.parametrize("seq,window", [(40, None), (40, 5), (64, 17), (96, 16)])
def test_the_window_skips_tiles_as_costs_says(seq: int, window: int | None) -> None:
    """Forward, dK/dV and dQ kernels each visit exactly the tiles of the closed form (16 x 16 tiles under the
    interpreter), per (batch, query head): linear in the sequence past the window."""
    batch, heads = 1, 2
    q, k, v, d_out, _ = problem(6, batch=batch, seq=seq, heads=heads, kv_heads=1)
    tiles = torch.zeros(3, dtype=torch.int32)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    K.flash_attention(qf, kf, vf, True, None, None, window=window, tiles=tiles).backward(d_out.float())
    per = batch * heads
    want = [flash_forward_tiles(seq, 16, 16, window), flash_dkdv_tiles(seq, 16, 16, window),
            flash_forward_tiles(seq, 16, 16, window)]
    assert tiles.tolist() == [per * w for w in want]
    if window is not None and window < 16:
        assert want[0] < flash_forward_tiles(seq, 16, 16)   # the window saved tiles


@pytest.mark.parametrize("softcap,with_docs", [(None, False), (2.0, False), (None, True), (2.0, True)])
def test_block_kernel_takes_the_window_in_positions_and_the_softcap(softcap: float | None, with_docs: bool) -> None:
    """One all-gather-like block (queries at zigzag positions, keys in rank order) with W = 6, and with documents
    (segment ids of the query rows and of the keys, cut inside the window and inside chunks, different per
    sequence): (O, LSE) and the backward from the merged statistics equal the torch block math; rows with no key
    in the block get LSE -inf."""
    b, hk, rep, d = 2, 2, 2, 8
    g = torch.Generator().manual_seed(7)
    q_pos = torch.tensor([0, 1, 2, 3, 28, 29, 30, 31] * 2)[:16]
    k_pos = torch.cat([torch.arange(0, 4), torch.arange(28, 32), torch.arange(4, 12), torch.arange(16, 28)])
    q = torch.randn(b, hk, rep, 16, d, generator=g)
    k, v = (torch.randn(b, hk, k_pos.shape[0], d, generator=g) for _ in range(2))
    full = torch.stack([torch.bucketize(torch.arange(32), torch.tensor(cuts), right=True)
                        for cuts in ([2, 7, 30], [5, 18, 29])])           # [b, 32] document ids by position
    docs = (full[:, q_pos], full[:, k_pos]) if with_docs else None
    mask, scores = PositionMask(q_pos, k_pos, 6, docs), Scores(0.3, softcap)
    out_t, lse_t = block_forward(q, k, v, scores, mask, "torch")
    out_k, lse_k = block_forward(q, k, v, scores, mask, "triton")
    torch.testing.assert_close(out_k, out_t, **TOL)
    torch.testing.assert_close(lse_k, lse_t, **TOL)
    d_out = torch.randn(out_t.shape, generator=g)
    delta = (d_out * out_t).sum(-1)
    for a, c in zip(block_backward(q, k, v, d_out, (lse_t, delta), scores, mask, "triton"),
                    block_backward(q, k, v, d_out, (lse_t, delta), scores, mask, "torch")):
        torch.testing.assert_close(a, c, **TOL)


def _cp_triton_rank_fn(rank: int, mode: str, with_docs: bool) -> list[int]:
    """ring / all-gather at cp = 2 on the Triton blocks under window + sinks + soft-cap (and documents: the
    blocks' segment ids; a mask tensor would be refused by the Triton backend), vs the reference."""
    testing.use_interpreter()  # this worker may have been started before TRITON_INTERPRET was set
    from megalite.context.attend import Local, Masking, context_attention
    from megalite.context.documents import DocumentIds
    from megalite.context.options import ContextOptions
    from megalite.context.zigzag import zigzag_split
    from tests.parallel_utils import layout

    st = layout(1, cp=2)
    q, k, v, d_out, sinks = problem(8, batch=2 if with_docs else 1, seq=16, heads=2, kv_heads=1)
    full = doc_ids(2, 16) if with_docs else None
    want = reference_grads(q, k, v, d_out, sinks, "all", full)
    local = [zigzag_split(t, 2, st.cp_rank).float().requires_grad_() for t in (q, k, v)]
    sf = sinks.float().requires_grad_()
    docs = None if full is None else DocumentIds(zigzag_split(full, 2, st.cp_rank), full)
    out = context_attention(*local, st, ContextOptions.of(mode), Local(lambda *a: a[0], "triton"),
                            Masking(docs, make_variant("all", sf)))
    out.backward(zigzag_split(d_out, 2, st.cp_rank).float())
    for label, a, b in zip(["out", "dq", "dk", "dv"], [out.detach()] + [grad(t) for t in local], want):
        torch.testing.assert_close(a, zigzag_split(b, 2, st.cp_rank).float(), **TOL, msg=lambda m: f"{label}: {m}")
    total = grad(sf).clone()
    torch.distributed.all_reduce(total, group=st.group("cp"))
    torch.testing.assert_close(total, want[4].float(), **TOL)
    return list(st.counter.tallies().values())


@pytest.mark.parametrize("mode,with_docs", [("ring", False), ("allgather", False), ("ring", True),
                                            ("allgather", True)])
def test_cp_on_triton_blocks_under_the_variants(dist_world, mode: str, with_docs: bool) -> None:
    dist_world(2).run(_cp_triton_rank_fn, mode, with_docs)


def test_variant_attention_on_triton_is_the_flash_kernel() -> None:
    """megalite/attention/local.py's triton path (what model/attend.py calls at cp = 1) equals its torch path."""
    from megalite.attention.local import variant_attention

    q, k, v, _, sinks = problem(9, batch=1, seq=SEQ, heads=2, kv_heads=1)
    docs = doc_ids(1, SEQ)
    variant = make_variant("all", sinks.float())
    got = variant_attention(q.float(), k.float(), v.float(), variant, docs, "triton")
    torch.testing.assert_close(got, variant_attention(q.float(), k.float(), v.float(), variant, docs, "torch"), **TOL)
