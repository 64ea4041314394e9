"""The cp modes (`parallel.cp_mode`: ring | allgather | a2a, megalite/context/options.py): the all-to-all
(Ulysses) attention against unsplit causal attention, its bytes against the closed form and the estimator,
its validation, and each mode trained through `pretrain.py`'s entry point at 4 ranks with the single-process losses and
the estimator's bytes. The ring and all-gather forms' own attention tests are tests/test_context_parallel.py;
every mode's multi-step training parity (cp 2 and 4, tp + sp, pp, recompute) is tests/test_cp_training.py.

Tolerances: as tests/test_context_parallel.py (fp32 attention vs an fp64 reference: 2e-5; the a2a form runs the
same SDPA on the whole sequence, permuted, so it is within the same rounding), and 1e-5 on O(1) training
losses (tests/test_cp_training.py). Bytes are integers: exact.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megalite.context.a2a import a2a_attention
from megalite.context.costs import cp_attention_bytes
from megalite.context.hybrid import hybrid_attention
from megalite.context.options import ContextOptions
from megalite.context.zigzag import zigzag_split
from megalite.errors import ConfigError
from megalite.model.ops import attention
from megalite.parallel.state import ParallelState
from megalite.perfmodel.estimate import PRESETS, Hardware, Layout, Precision, estimate
from tests.test_context_parallel import TOL, _problem, _reference
from tests.test_cp_training import problems

SEQ_TOKENS = 2 * 4 * 3  # splits into 2 cp chunks at cp = 4


def _a2a_rank_fn(rank: int, cp: int, tp: int, heads: int, kv_heads: int) -> tuple[float, float]:
    from tests.parallel_utils import layout

    st = layout(tp, cp=cp)
    batch, d = 2, 8
    q, k, v, d_out = _problem(200 + st.dp_rank * 10 + st.tp_rank, batch, SEQ_TOKENS, heads, kv_heads, d)
    local = [zigzag_split(t, cp, st.cp_rank).float().requires_grad_() for t in (q, k, v)]
    out = a2a_attention(*local, st, attention)
    fwd = st.counter.exact_bytes("cp")
    out.backward(zigzag_split(d_out, cp, st.cp_rank).float())
    bwd = st.counter.exact_bytes("cp") - fwd
    for name, a, b in zip(["out", "dq", "dk", "dv"], [out.detach()] + [t.grad for t in local],
                          _reference(q, k, v, d_out)):
        torch.testing.assert_close(a, zigzag_split(b, cp, st.cp_rank).float(), **TOL, msg=lambda m: f"{name}: {m}")
    want = cp_attention_bytes(ContextOptions.of("a2a"), batch, SEQ_TOKENS, heads, kv_heads, d, cp, 4)
    assert (fwd, bwd) == (want.forward, want.backward), (fwd, bwd, want)
    return float(fwd), float(bwd)


@pytest.mark.parametrize("cp,tp,heads,kv_heads", [(2, 1, 6, 2), (4, 1, 8, 4), (4, 1, 4, 4), (2, 2, 4, 2)])
def test_a2a_attention_equals_unsplit(dist_world, cp: int, tp: int, heads: int, kv_heads: int) -> None:
    """4 ranks: the zigzag split of unsplit causal GQA attention's output and dq/dk/dv on every rank (beside
    tp = 2 each tp rank has its own problem: its own heads), and the closed form's bytes."""
    results = dist_world(4).run(_a2a_rank_fn, cp, tp, heads, kv_heads)
    assert len(set(results)) == 1 and results[0][0] > 0


def _hybrid_rank_fn(rank: int, a2a: int, eod: int | None) -> tuple[float, float]:
    """cp = 4 as a2a x ring (2 x 2, and the degenerate 4 x 1 and 1 x 4): the zigzag split of unsplit causal
    attention (under documents when `eod` is set: masked SDPA over the whole sequence) and the closed form's bytes."""
    from megalite.context.documents import DocumentIds, document_causal_mask, documents
    from megalite.model.ops import masked_attention
    from tests.parallel_utils import layout

    st, cp, batch, heads, kv_heads, d = layout(1, cp=4), 4, 2, 4, 4, 8
    q, k, v, d_out = _problem(300 + a2a, batch, SEQ_TOKENS, heads, kv_heads, d)
    docs = None
    if eod is not None:  # documents of 5, 9 and 10 tokens: boundaries inside zigzag chunks, and across ranks
        tokens = torch.arange(1, SEQ_TOKENS + 1).repeat(batch, 1)
        tokens[:, [4, 13]] = eod
        full = documents(tokens, eod).ids
        docs = DocumentIds(zigzag_split(full, cp, st.cp_rank), full)
    local = [zigzag_split(t, cp, st.cp_rank).float().requires_grad_() for t in (q, k, v)]
    out = hybrid_attention(*local, st, a2a, docs=docs)
    fwd = st.counter.exact_bytes("cp")
    out.backward(zigzag_split(d_out, cp, st.cp_rank).float())
    bwd = st.counter.exact_bytes("cp") - fwd
    if docs is None:
        want_all = _reference(q, k, v, d_out)
    else:
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out = masked_attention(*ref, document_causal_mask(docs.full, docs.full))
        ref_out.backward(d_out.double())
        want_all = [ref_out.detach()] + [t.grad for t in ref]
    for name, a, b in zip(["out", "dq", "dk", "dv"], [out.detach()] + [t.grad for t in local], want_all):
        torch.testing.assert_close(a, zigzag_split(b, cp, st.cp_rank).float(), **TOL, msg=lambda m: f"{name}: {m}")
    want = cp_attention_bytes(ContextOptions.of("hybrid", a2a_degree=a2a), batch, SEQ_TOKENS, heads, kv_heads, d, cp,
                              4)
    assert (fwd, bwd) == (want.forward, want.backward), (fwd, bwd, want)
    return float(fwd), float(bwd)


def _hybrid_cases_rank_fn(rank: int) -> list[tuple[float, float]]:
    return [_hybrid_rank_fn(rank, a2a, eod) for a2a, eod in ((2, None), (2, 0), (4, None), (1, 0))]


def test_hybrid_attention_equals_unsplit(dist_world) -> None:
    """One spawn, four cases: a2a 2 x ring 2 (plain and under documents), 4 x 1 (= a2a), 1 x 4 (= the ring)."""
    results = dist_world(4).run(_hybrid_cases_rank_fn)
    assert all(r == results[0] for r in results) and all(fwd > 0 for fwd, _ in results[0])


def test_a2a_refuses_heads_that_do_not_split() -> None:
    with pytest.raises(ConfigError, match="not both divisible by cp = 2"):
        a2a_attention(*(torch.zeros(1, 4, h, 8) for h in (4, 1, 1)), ParallelState(cp=2), attention)


def test_validation_explains_the_a2a_head_rule() -> None:
    base = ("--parallel.cp_mode", "a2a", "--model.seq_len", "32", "--model.num_heads", "8")
    assert problems(4, *base, "--parallel.cp", "2", "--parallel.tp", "2", "--model.num_kv_heads", "4") == ""
    msg = problems(4, *base, "--parallel.cp", "4", "--model.num_kv_heads", "2")
    assert "cp_mode=a2a splits each tp rank's 8 query and 2 kv heads" in msg and "divisible by cp" in msg
    assert msg.count("\n") == 0
    assert problems(2, "--parallel.cp", "2", "--parallel.cp_mode", "ulysses").endswith(
        "parallel.cp_mode: 'ulysses' is not one of ring, allgather, a2a, hybrid")
    hybrid = ("--parallel.cp_mode", "hybrid", "--model.seq_len", "32", "--model.num_heads", "8", "--parallel.cp", "4")
    assert problems(4, *hybrid, "--model.num_kv_heads", "2", "--parallel.cp_a2a", "2") == ""  # a2a 2 x ring 2
    msg = problems(4, *hybrid, "--model.num_kv_heads", "2", "--parallel.cp_a2a", "4")
    assert "cp_mode=hybrid splits each tp rank's 8 query and 2 kv heads" in msg and "into cp_a2a = 4" in msg
    assert "must be >= 1 and divide parallel.cp = 4" in problems(4, *hybrid, "--parallel.cp_a2a", "3")


@pytest.mark.parametrize("mode", ["ring", "allgather", "a2a", "hybrid"])
def test_estimator_cp_bytes_are_each_modes_closed_form(mode: str) -> None:
    """Per step: the closed form x layers of the stage x micro-batches (x 2 forwards under full recompute)."""
    dims = replace(PRESETS["llama2-70b"], seq_len=32768)  # 64 heads, 8 kv heads: 4 per tp rank at tp = 2
    for lay in (Layout(tp=2, cp=4, sp=True, global_batch_size=4, cp_mode=mode, cp_a2a=2),
                Layout(tp=2, cp=4, pp=2, micro_batch_size=2, global_batch_size=8, recompute="full", cp_mode=mode,
                       cp_a2a=2)):
        prec = Precision.megalite("bf16")
        est = estimate(dims, lay, prec)
        call = cp_attention_bytes(ContextOptions.of(mode, a2a_degree=lay.cp_a2a), lay.micro_batch_size, dims.seq_len,
                                  dims.num_heads // lay.tp, dims.kv_heads // lay.tp, dims.hd, lay.cp, prec.activation)
        per_layer = call.total + (call.forward if lay.recompute == "full" else 0)
        assert est.comm_bytes["cp"] == per_layer * dims.num_layers // lay.pp * est.num_microbatches, lay


def test_estimator_allgather_holds_the_gathered_kv_and_exposes_its_transfers() -> None:
    dims = replace(PRESETS["llama-7b"], seq_len=32768)
    kw = Hardware(peak_flops=989e12, inter_bytes_per_s=25e9, intra_bytes_per_s=450e9)
    ring, gather, a2a = (estimate(dims, Layout(tp=8, cp=4, sp=True, global_batch_size=2, cp_mode=m), hw=kw)
                         for m in ("ring", "allgather", "a2a"))
    kv = 2 * 8192 * (32 // 8) * 128 * 2  # this rank's K/V bytes per layer (bf16, 4 kv heads per tp rank)
    assert gather.memory.activations - ring.memory.activations == pytest.approx(3 * kv * 32, rel=1e-12)
    assert a2a.memory.activations == ring.memory.activations
    for est in (gather, a2a):  # not overlapped: every byte on the critical path
        assert est.cp_exposed_seconds == pytest.approx(est.comm_seconds["cp"], rel=1e-12)
    with pytest.raises(ConfigError, match="cp_mode='x'"):
        Layout(cp=2, cp_mode="x")
    with pytest.raises(ConfigError, match="cp_mode=a2a at cp=8: 4 query and 4 kv heads per tp rank"):
        estimate(dims, Layout(tp=8, cp=8, global_batch_size=2, cp_mode="a2a"))


# ------------------------------------------------------------------ end to end, pretrain.py at 4 ranks

@pytest.mark.parametrize("mode,model,flags", [
    # 4 heads and 4 kv heads: 2 per tp rank, 1 per a2a rank
    ("a2a", ("--model.num_kv_heads", "4"), ("--parallel.tp", "2", "--parallel.sp", "true", "--parallel.cp", "2")),
    ("allgather", ("--train.global_batch_size", "8"), ("--parallel.pp", "2", "--parallel.cp", "2")),
    # cp 4 = a2a 2 x ring 2 under document masking (the EODs of the corpus): the ring inside hybrid and the masks;
    # the plain ring trains through pretrain.py in tests/test_cp_pretrain.py
    ("hybrid", ("--data.document_mask", "true"), ("--parallel.cp", "4", "--parallel.cp_a2a", "2")),
])
def test_pretrain_cp_mode_matches_single_process_and_the_estimate(mode: str, model: tuple[str, ...],
                                                                  flags: tuple[str, ...], dist_world,
                                                                  demo_cache_dir: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from pretrain import main
    from tests.pool_pretrain import run_pretrain_in_pool
    from tests.test_pretrain import _args, _losses
    from tools.estimate import main as estimate_main

    steps = ("--train.steps", "3", *model)
    assert main(_args(demo_cache_dir, tmp_path / "one", *steps)) == 0
    # pretrain.py's entry point in the session's 4 warm ranks (tests/pool_pretrain.py), not a torchrun job
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, tmp_path / "cp", *steps, "--parallel.cp_mode",
                                                  mode, *flags), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, cp = _losses(tmp_path / "one"), _losses(tmp_path / "cp")
    assert sorted(one) == sorted(cp) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - cp[step]) < 1e-5, f"{mode} step {step}: {cp[step]} != single-process {one[step]}"
    last = json.loads((tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert estimate_main(["--config", str(tmp_path / "cp" / "config.toml"), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["inputs"]["layout"]["cp_mode"] == mode
    assert last["comm_bytes"]["cp"] > 0
    for group in ("cp", "tp", "pp"):
        assert last["comm_bytes"].get(group, 0.0) == pytest.approx(predicted["comm_bytes"].get(group, 0.0),
                                                                   rel=1e-12), group
