"""Context parallelism in the cost model: the cp ring's bytes equal megalite/context/costs.py's closed form x
layers x micro-batches, activation memory per rank falls as 1/cp, dp traffic and ZeRO shards span dp x cp,
TP/SP/PP traffic moves S/cp tokens, the ring's transfers hide behind attention compute step by step, cp = 1
is exactly the estimator it was before cp, and the CLI takes `--parallel.cp`.

`test_measured_cp_run_equals_estimate` runs `pretrain.py --parallel.cp 2` at 4 ranks and holds its measured
bytes equal to the estimate's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megalite.context.options import ContextOptions
from megalite.context.costs import cp_attention_bytes, ring_attention_bytes
from megalite.perfmodel.context import cp_comm_bytes, ring_exposed_seconds
from megalite.perfmodel.estimate import (GB, PRESETS, Hardware, Layout, ModelDims, Precision, estimate, pp_comm_bytes,
                                         tp_comm_bytes)
from tests.conftest import SMALL_RUN
from tests.pool_pretrain import run_pretrain_in_pool
from tools.estimate import main as estimate_main

H100 = Hardware(peak_flops=989e12, inter_bytes_per_s=25 * GB, intra_bytes_per_s=450 * GB)
LONG_7B = replace(PRESETS["llama-7b"], seq_len=32768)
GQA_70B = replace(PRESETS["llama2-70b"], seq_len=16384)  # 8 kv heads of 64


@pytest.mark.parametrize("dims,layout,prec", [
    (LONG_7B, Layout(cp=2, dp=2, micro_batch_size=1, global_batch_size=4), Precision()),
    (LONG_7B, Layout(tp=8, cp=4, sp=True, zero=1, recompute="selective", global_batch_size=8), Precision()),
    (GQA_70B, Layout(tp=8, cp=8, pp=4, sp=True, micro_batch_size=1, global_batch_size=16, recompute="full"),
     Precision.megalite("bf16")),
    (GQA_70B, Layout(tp=2, cp=4, pp=2, vpp=2, micro_batch_size=2, global_batch_size=8), Precision.for_dtype("fp32")),
])
def test_cp_bytes_are_the_ring_closed_form_times_layers_and_micro_batches(dims: ModelDims, layout: Layout,
                                                                         prec: Precision) -> None:
    est = estimate(dims, layout, prec)
    per_call = ring_attention_bytes(layout.micro_batch_size, dims.seq_len, dims.kv_heads // layout.tp, dims.hd,
                                    layout.cp, prec.activation)
    reruns = 1 if layout.recompute == "full" else 0  # full recompute runs the ring forward once more (not selective)
    per_layer = per_call.total + reruns * per_call.forward
    expected = per_layer * dims.num_layers // layout.pp * est.num_microbatches
    assert est.comm_bytes["cp"] == expected  # integers of bytes: exact


@pytest.mark.parametrize("layout", [
    Layout(micro_batch_size=1, global_batch_size=8),
    Layout(tp=4, sp=True, micro_batch_size=2, global_batch_size=8, recompute="selective"),
    Layout(tp=2, pp=4, micro_batch_size=1, global_batch_size=16, recompute="full"),
])
def test_activation_memory_per_rank_falls_as_one_over_cp(layout: Layout) -> None:
    """Every activation term is for S/cp local tokens (the attention scores: S/cp queries x S keys), so the
    bytes per rank are the cp = 1 bytes / cp; the model states do not change (no ZeRO: replicated over cp)."""
    one = estimate(LONG_7B, layout)
    for cp in (2, 4, 8):
        est = estimate(LONG_7B, replace(layout, cp=cp))
        # The same products in another order: float rounding only.
        assert est.memory.activations == pytest.approx(one.memory.activations / cp, rel=1e-12), cp
        assert est.memory.model_states == one.memory.model_states


def test_dp_traffic_and_zero_shards_span_dp_times_cp() -> None:
    """Replicated parameters are reduced, and ZeRO-sharded, over the dp x cp ranks holding them: dp = 2, cp = 4
    moves the dp bytes of dp = 8 and holds its shards."""
    dims = replace(PRESETS["llama-1b"], seq_len=8192)
    for zero in (0, 1, 2, 3):
        prec = Precision.megalite("bf16")
        with_cp = estimate(dims, Layout(dp=2, cp=4, zero=zero, micro_batch_size=1, global_batch_size=4), prec)
        wide = estimate(dims, Layout(dp=8, zero=zero, micro_batch_size=1, global_batch_size=16), prec)
        assert with_cp.comm_bytes["dp"] == wide.comm_bytes["dp"], zero
        assert with_cp.memory.model_states == wide.memory.model_states, zero


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tp_and_pp_traffic_move_s_over_cp_tokens(recompute: str) -> None:
    """tp (with SP) and pp bytes of a cp = 4 rank are those of the same model on S/4-token sequences
    (llama: SP's partial gradients are norm weights, independent of S)."""
    lay = Layout(tp=4, pp=2, sp=True, zero=1, dp=2, micro_batch_size=2, global_batch_size=8, recompute=recompute)
    short = replace(LONG_7B, seq_len=LONG_7B.seq_len // 4)
    m = lay.num_microbatches
    for rank in (0, 1):
        # The ZeRO >= 1 partial-gradient sum divides by dp·cp: compare against dp·cp = 8 at cp = 1.
        assert tp_comm_bytes(LONG_7B, replace(lay, cp=4), Precision(), rank, m) == pytest.approx(
            tp_comm_bytes(short, replace(lay, dp=8), Precision(), rank, m), rel=1e-12)
        assert pp_comm_bytes(LONG_7B, replace(lay, cp=4), Precision(), rank, m) == pp_comm_bytes(
            short, lay, Precision(), rank, m)


def test_ring_transfers_hide_behind_attention_compute_step_by_step() -> None:
    """Per ring step the time is max(transfer, compute): at H100 speeds a 32K sequence's ring is hidden; on a
    slow link exactly the excess is exposed, and the overlapped step time adds only that."""
    lay = Layout(tp=8, cp=4, sp=True, micro_batch_size=1, global_batch_size=2)
    est = estimate(LONG_7B, lay, hw=H100)
    assert est.comm_bytes["cp"] > 0 and est.cp_exposed_seconds == 0.0
    others = sum(sec for g, sec in est.comm_seconds.items() if g not in ("dp", "cp"))
    assert est.step_seconds_overlapped == pytest.approx(max(est.compute_seconds, est.comm_seconds["dp"]) + others)
    assert est.step_seconds == pytest.approx(est.compute_seconds + sum(est.comm_seconds.values()))

    slow = 1e9  # 1 GB/s for the ring: the transfers dominate
    est = estimate(LONG_7B, lay, hw=replace(H100, cp_bytes_per_s=slow))
    # By hand: one ring step, per layer and micro-batch (S/cp = 8192 tokens, 4 local kv heads of 128).
    s, kv = 8192, 2 * 8192 * 4 * 128
    block = 2.0 * s * s * 4 * 128 / 989e12  # half a (S/cp)² block, 32/8 = 4 query heads, forward
    fwd, bwd = max(0.0, kv * 2 / slow - block), max(0.0, kv * 6 / slow - 2 * block)
    assert fwd > 0 and bwd > 0
    expected = est.num_microbatches * LONG_7B.num_layers * 3 * (fwd + bwd)  # cp - 1 = 3 transferring steps
    assert est.cp_exposed_seconds == pytest.approx(expected, rel=1e-12)
    assert est.cp_exposed_seconds < est.comm_seconds["cp"]
    others = sum(sec for g, sec in est.comm_seconds.items() if g not in ("dp", "cp"))
    assert est.step_seconds_overlapped == pytest.approx(
        max(est.compute_seconds, est.comm_seconds["dp"]) + others + expected, rel=1e-12)
    assert ring_exposed_seconds(LONG_7B, replace(lay, cp=1), Precision(), 1, 1e12, 1e9) == 0.0
    assert cp_comm_bytes(LONG_7B, replace(lay, cp=1), Precision(), 1) == 0.0


# What the estimator printed for these layouts before it knew cp (numbers the existing tests pin come
# from the same functions): cp = 1 must reproduce them bit for bit.
_BEFORE_CP = [
    ("llama-7b", dict(tp=2, pp=4, dp=8, zero=1, sp=True, micro_batch_size=1, global_batch_size=512), "paper",
     56889540608.0, 52076478464.0, {"dp": 3062872064.0, "tp": 70870123520.0, "pp": 2147483648.0},
     1.964383605225624, 1.841868722665624),
    ("gpt2-medium", dict(tp=4, pp=2, dp=2, zero=3, sp=True, vpp=3, schedule="interleaved", micro_batch_size=2,
                         global_batch_size=32, recompute="selective"), "paper",
     913195008.0, 499122176.00000006, {"dp": 1242218496.0, "tp": 2467934208.0, "pp": 41943040.0,
                                       "embedding": 25733120.0}, 0.06332315078535895, 0.05788008448),
    ("llama-1b", dict(tp=1, pp=1, dp=8, zero=2, micro_batch_size=4, global_batch_size=256, recompute="full"),
     "megalite", 12937601024.0, 7994343424.0, {"dp": 6488025600.0}, 0.9509543030697027, 0.6914332790697028),
    ("gpt3-175b", dict(tp=8, pp=8, dp=16, sp=True, micro_batch_size=1, global_batch_size=1536, recompute="full"),
     # tp: full recompute re-runs 3 of a block's 4 SP collectives (torch's checkpoint stops early), was 4 of 4
     "paper", 46103298048.0, 962592768.0, {"dp": 10579852800.0, "tp": 566624206848.0, "pp": 1207959552.0,
                                           "embedding": 154411008.0}, 6.515652111975366, 6.092457999975366),
    ("llama2-70b", dict(tp=8, pp=4, dp=4, zero=1, sp=True, schedule="zbv", micro_batch_size=1, global_batch_size=64),
     "megalite", 84710924288.0, 65161134080.0, {"dp": 9774895104.0, "tp": 152204867584.0, "pp": 536870912.0},
     1.6999107230288013, 1.3089149188688012),
]


@pytest.mark.parametrize("case", _BEFORE_CP, ids=[c[0] for c in _BEFORE_CP])
def test_cp_1_is_the_estimate_from_before_cp(case: tuple) -> None:
    name, kw, prec_name, total, acts, comm, step, overlapped = case
    prec = Precision.megalite("bf16") if prec_name == "megalite" else Precision()
    est = estimate(PRESETS[name], Layout(**kw, cp=1), prec, hw=H100)
    assert (est.memory.total, est.memory.activations, est.comm_bytes) == (total, acts, comm)
    assert (est.step_seconds, est.step_seconds_overlapped) == (step, overlapped)
    assert est.cp_exposed_seconds is None


def test_cli_prints_the_cp_line_and_refuses_a_bad_split(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "llama-7b", "--seq-len", "32768", "--tp", "8", "--sp", "--global-batch-size", "8",
            "--device", "H100", "--bandwidth-gbps", "400", "--intra-bandwidth-gbytes", "450"]
    assert estimate_main(args + ["--json", "--cp", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["layout"]["cp"] == 4 and data["comm_bytes"]["cp"] > 0
    assert estimate_main(args + ["--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=8 cp=4 pp=1" in out and "8192 of 32768 tokens per rank" in out
    assert any(line.split()[:1] == ["cp"] for line in out.splitlines())  # the comm table's cp row
    # pretrain's flag name (a config override: its dtype, fp32 on CPU, unless given)
    assert estimate_main(args + ["--parallel.cp", "4", "--dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["comm_bytes"]["cp"] == data["comm_bytes"]["cp"]
    assert estimate_main(["--preset", "tiny", "--cp", "3"]) == 2  # 128 tokens are not 6 equal chunks
    err = capsys.readouterr().err
    assert err.startswith("error: seq_len 128") and err.count("\n") == 1


# ------------------------------------------------------------------ measured (needs the model wired for cp)

def _pretrain_at(dist_world, cache: str, log_dir: Path, nproc: int, *extra: str) -> None:
    """pretrain.py's entry point in the session's warm ranks of that world size (tests/pool_pretrain.py)."""
    args = ["--data.cache_dir", cache, *SMALL_RUN, "--train.steps", "2", "--logging.dir", str(log_dir), *extra]
    proc = run_pretrain_in_pool(dist_world, args, nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_run_equals_estimate(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cp, tp and dp bytes rank 0 logged in `run_dir`/metrics.jsonl (last step) and its model-state bytes
    equal `tools/estimate.py --config <run_dir>/config.toml`'s, exactly. (tests/test_cp_pretrain.py holds it
    for cp 2 x tp 2 with sequence parallelism.)"""
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert estimate_main(["--config", str(run_dir / "config.toml"), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["inputs"]["layout"]["cp"] == 2
    for group in ("cp", "tp", "dp"):
        assert last["comm_bytes"].get(group, 0.0) == pytest.approx(predicted["comm_bytes"].get(group, 0.0),
                                                                   rel=1e-12), group
    assert last["comm_bytes"]["cp"] > 0
    for kind in ("params", "grads", "master", "optimizer"):
        assert last["mem_bytes"][kind] == predicted["memory"][kind], kind  # integers of bytes: exact


def test_measured_cp_run_equals_estimate(dist_world, demo_cache_dir: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """4 ranks at cp 2 x dp 2 with ZeRO 1: dp traffic and ZeRO shards over dp x cp = 4."""
    from megalite.data import prepare_demo_data

    prepare_demo_data(demo_cache_dir, 300_000, 512)  # once, before four ranks race to build it
    _pretrain_at(dist_world, demo_cache_dir, tmp_path, 4, "--parallel.cp", "2", "--parallel.zero", "1")
    assert_run_equals_estimate(tmp_path, capsys)


def test_memory_check_counts_cp_and_suggests_it() -> None:
    """The check before step 1 sizes a cp run's S/cp activations, and on the same processes suggests cp
    (dp halves, each rank holds half of every sequence) when that is what fits."""
    import torch

    from megalite.config import parse_args, resolve
    from megalite.errors import ConfigError
    from megalite.training.memory_check import alternatives, check_memory_of, predicted_bytes

    # ZeRO-3 and full recompute already: the only single change left is cp (states sharded over dp·cp = 4).
    # The Triton ring blocks keep no block-pair scores (the torch blocks' (S/cp)² scores would outweigh the saving).
    # Global batch 8: several micro-batches per rank at every cp, so ZeRO-3's full gradient buckets are held in the
    # loss phase at each of them (a constant) and what changes with cp is the S/cp tokens' share alone.
    cfg = resolve(parse_args(["--model.preset", "llama-160m", "--model.vocab_size", "32000", "--model.seq_len",
                              "8192", "--train.micro_batch_size", "1", "--train.global_batch_size", "8",
                              "--parallel.zero", "3", "--model.recompute", "full", "--model.kernels", "triton"]), 4)
    need = [4 * predicted_bytes(replace(cfg, parallel=replace(cfg.parallel, cp=cp, dp=4 // cp))) for cp in (1, 2, 4)]
    assert need[0] - need[1] == pytest.approx(2 * (need[1] - need[2]), rel=1e-9)  # activations: A, A/2, A/4
    assert [(a.flags, a.needed) for a in alternatives(cfg, 4, int(need[1]) + 1)] == [
        ("--parallel.cp 2", need[1]), ("--parallel.cp 4", need[2])]
    assert [a.flags for a in alternatives(cfg, 4, int(need[2]) + 1)] == ["--parallel.cp 4"]
    with pytest.raises(ConfigError, match="these fit: --parallel.cp 2 "):
        check_memory_of(cfg, torch.device("cpu"), 4, available=int(need[1]) + 1)


# ------------------------------------------------------------------ bench/cp_memory.py

def test_cp_memory_bench_estimate_half_and_its_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the benchmark predicts (no runs): activations per rank 1/cp of cp = 1's, fused and unfused; the
    same model states; cp bytes = the mode's closed form x 4 layers (one micro-batch, fp32); the all-gather
    form holds the other ranks' K/V besides. Bad sizes: exit 2."""
    from bench.cp_memory import main as bench_main

    assert bench_main(["--out", str(tmp_path), "--estimate-only"]) == 0  # in-process: no run, no rank to start
    rows = json.loads((tmp_path / "cp_memory_estimate.json").read_text())["rows"]
    modes = ["ring", "allgather", "a2a"]
    assert [(r["cp"], r["mode"]) for r in rows] == [(1, "ring")] + [(cp, m) for cp in (2, 4) for m in modes] + [
        (4, "hybrid")]  # a2a 2 x ring 2
    assert [r["tokens_per_rank"] for r in rows] == [4096] + [2048] * 3 + [1024] * 4
    one = rows[0]["predicted"]
    for r in rows:
        p = r["predicted"]
        held = 0 if r["mode"] != "allgather" else (r["cp"] - 1) * 2 * (4096 // r["cp"]) * 4 * 64 * 4 * 4  # 4 layers
        for kind in ("activations", "activations_fused"):
            assert p[kind] == pytest.approx(one[kind] / r["cp"] + held, rel=1e-12), kind
        assert p["model_states"] == one["model_states"]
        a2a = 2 if r["mode"] == "hybrid" else 1
        options = ContextOptions.of(r["mode"], a2a_degree=a2a)
        assert p["cp_bytes"] == 4 * cp_attention_bytes(options, 1, 4096, 8, 4, 64, r["cp"], 4).total  # 512/8 = 64
    assert "| 4 | a2a | 1024 | estimate only |" in (tmp_path / "cp_memory_estimate.md").read_text()
    # The refusals: argparse's exit 2 with one "error:" line.
    for bad in (["--cp", "3"], ["--cp", "0"], ["--max-memory-gb", "0"], ["--seq", "100"], ["--modes", "x"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["--out", str(tmp_path), "--estimate-only", *bad])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "error:" in err and "Traceback" not in err, bad


def test_cp_memory_bench_names_the_sizes_that_fit_a_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--render` re-reads a run's JSON: a row fits when its largest rank's peak RSS is within the budget."""
    rows = [{"cp": cp, "tokens_per_rank": 4096 // cp, "tokens_per_s": 100.0, "cp_bytes_measured": 0.0,
             "peak_rss_bytes_per_rank": [rss] * cp,
             "predicted": {"model_states": 1.0, "activations": 2.0, "activations_fused": 1.0, "cp_bytes": 0.0}}
            for cp, rss in ((1, 1.3e9), (2, 0.9e9), (4, 0.7e9))]
    res = tmp_path / "cp_memory.json"
    res.write_text(json.dumps({"date": "-", "cores": 2, "model_desc": "-", "fixed_rss_bytes": 2e8, "rows": rows}))
    from bench.cp_memory import main as bench_main

    capsys.readouterr()
    assert bench_main(["--out", str(tmp_path), "--render", str(res), "--max-memory-gb", "1.1"]) == 0  # in-process
    out = capsys.readouterr().out
    assert "Budget 1.1 GB per rank (measured peak RSS): cp = 2, 4 fit." in out
    assert "| 1 | - | 4096 | 1240 | 1049 |" in out and out.count(" no |") == 1


def test_cp_memory_bench_smoke_runs_cp_1_and_2(tmp_path: Path, demo_cache_dir: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The smoke run's measured cp bytes equal the estimator's, at cp = 1 and at cp = 2 in the a2a mode (the ring's
    are `test_measured_cp_run_equals_estimate`'s), and every run trains. The script's driver runs in this process
    (its runs are its own fresh processes, as peak RSS needs) on the session's demo corpus (MEGALITE_CACHE)."""
    from bench.cp_memory import main as bench_main

    monkeypatch.setenv("MEGALITE_CACHE", demo_cache_dir)
    assert bench_main(["--out", str(tmp_path), "--smoke", "--max-memory-gb", "100"]) == 0
    rows = json.loads((tmp_path / "cp_memory_smoke.json").read_text())["rows"]
    assert [(r["cp"], r["mode"]) for r in rows] == [(1, "ring"), (2, "a2a")]
    for r in rows:
        assert "skipped" not in r, r.get("stderr_tail")
        assert r["tokens_per_s"] > 0 and len(r["peak_rss_bytes_per_rank"]) == r["cp"]
        assert r["cp_bytes_measured"] == pytest.approx(r["predicted"]["cp_bytes"], rel=1e-12)
