"""The layout planner: the issue's two worked cases, memory as `estimate` computes it, the pruning
checked against brute force, a clear error when nothing fits, the size of the search, context parallelism
(asked for, or automatic when a sequence fits nowhere), and the CLI."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from megalite.errors import ConfigError
from megalite.perfmodel.estimate import GB, PRESETS, Hardware, Layout, Precision, estimate
from megalite.perfmodel.compare import compare
from megalite.perfmodel.peak_memory import PLANNER_PEAK, _as_estimated, run_peak, stage_peak
from megalite.perfmodel.plan import (RULES, TIE_TOLERANCE, Cluster, Search, _rules_key, auto_cp_sizes, differences,
                                     make_plan, worst_stage_memory)
from tools.plan import main as plan_main

H100_NODE = dict(gpus_per_node=8, gpu_memory_bytes=80 * GB, intra_bytes_per_s=450 * GB,
                 inter_bytes_per_s=25 * GB, peak_flops=989e12)


def test_175b_on_1024_gpus_keeps_tp_in_a_node_and_fits() -> None:
    cluster = Cluster(nodes=128, **H100_NODE)
    plan = make_plan(PRESETS["gpt3-175b"], cluster, global_batch_size=1536)
    best = plan.ranked[0].layout
    assert best.tp <= 8 and 8 % best.tp == 0
    assert best.world == 1024
    # Re-cost the winner independently, as the check before step 1 would on a GPU: its worst stage fits.
    peak = run_peak(PRESETS["gpt3-175b"], best, Precision(), device="cuda", torch_ring=False)
    assert peak.total <= cluster.memory_limit <= 80 * GB
    assert best.tp * best.pp > 1  # 2.8 TB of model states cannot be plain data parallel
    assert all(worst_stage_memory(PRESETS["gpt3-175b"], c.layout, Precision()) <= cluster.memory_limit
               for c in plan.ranked)


def test_1b_on_8_gpus_is_pure_data_parallel() -> None:
    plan = make_plan(PRESETS["llama-1b"], Cluster(nodes=1, **H100_NODE), global_batch_size=256)
    best = plan.ranked[0].layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8)
    assert "wins" in plan.why and "GB" in plan.why


def test_model_that_fits_nowhere_says_so() -> None:
    small = dict(H100_NODE, gpus_per_node=2, gpu_memory_bytes=16 * GB)
    with pytest.raises(ConfigError, match="fits on no layout of 2 GPUs.*add nodes"):
        make_plan(PRESETS["llama-7b"], Cluster(nodes=1, **small), global_batch_size=8)


@pytest.mark.parametrize("layout", [
    Layout(tp=2, pp=4, dp=2, zero=1, sp=True, micro_batch_size=2, global_batch_size=32),
    Layout(tp=1, pp=4, dp=2, zero=3, vpp=2, schedule="interleaved", micro_batch_size=1, global_batch_size=16,
           recompute="selective"),
    Layout(tp=4, pp=2, dp=1, micro_batch_size=4, global_batch_size=8, recompute="full"),
    Layout(tp=2, cp=4, pp=2, dp=2, zero=2, sp=True, micro_batch_size=1, global_batch_size=8),
])
def test_worst_stage_memory_equals_estimate(layout: Layout) -> None:
    """Only the first and last stage are sized during the search: the peak over every stage is theirs, and it is
    the estimator's floor plus the peak model's other terms (`megalite.perfmodel.peak_memory`)."""
    dims = PRESETS["gpt2-medium"]
    every = [stage_peak(dims, _as_estimated(layout), Precision(), r, PLANNER_PEAK).total for r in range(layout.pp)]
    assert worst_stage_memory(dims, layout, Precision()) == max(every)
    # The same number the check before step 1 and `tools/estimate.py --memory-device cuda` give this layout.
    assert worst_stage_memory(dims, layout, Precision()) == run_peak(dims, layout, Precision(), device="cuda",
                                                                     torch_ring=False).total


def test_pruning_loses_nothing_against_brute_force() -> None:
    """Cost every (tp, pp, zero, recompute, vpp, micro-batch) with `estimate` and compare the
    fastest fitting one with the planner's winner (a tie, as `rank` defines it, is allowed)."""
    dims, gbs = PRESETS["gpt2-medium"], 32
    cluster = Cluster(nodes=2, **dict(H100_NODE, gpus_per_node=4, gpu_memory_bytes=12 * GB))
    plan = make_plan(dims, cluster, gbs)
    fastest = float("inf")
    for tp, pp, zero, rc, vpp, mbs in itertools.product((1, 2, 4), (1, 2, 4, 8), (0, 1, 2, 3),
                                                        ("none", "selective", "full"), (1, 2, 3), (1, 2, 4)):
        dp = 8 // (tp * pp) if 8 % (tp * pp) == 0 else 0
        if not dp or gbs % (dp * mbs) or (pp == 1 and vpp > 1) or 24 % (pp * vpp):
            continue
        m = gbs // (dp * mbs)
        if m < pp or (vpp > 1 and m % pp):
            continue
        lay = Layout(tp=tp, pp=pp, dp=dp, zero=zero, sp=tp > 1, vpp=vpp, micro_batch_size=mbs,
                     global_batch_size=gbs, recompute=rc, schedule="interleaved" if vpp > 1 else "1f1b")
        est = estimate(dims, lay, hw=Hardware(peak_flops=989e12, inter_bytes_per_s=25 * GB, intra_bytes_per_s=450 * GB))
        if worst_stage_memory(dims, lay, Precision()) <= cluster.memory_limit:  # the planner's own fit filter
            fastest = min(fastest, est.step_seconds_overlapped)
    assert fastest < float("inf")
    # The planner may pick a rule-preferred layout up to TIE_TOLERANCE slower, never more.
    assert fastest <= plan.ranked[0].step_seconds <= fastest * (1 + TIE_TOLERANCE) * (1 + 1e-12)
    # What pruning may skip (a higher ZeRO stage whose only gain is the 1/dp-smaller TP sum of
    # norm grads under SP) is worth < 0.1% of the step here; nothing bigger may be lost.
    assert min(c.step_seconds for c in plan.ranked) == pytest.approx(fastest, rel=1e-3)


def test_1024_gpu_search_stays_small() -> None:
    """The pruning keeps a 1024-GPU search to a few thousand memory sizings and a few hundred full estimates
    (counted, never timed: 3063/417 and 1244/194 when written; a larger search means the pruning broke)."""
    big = make_plan(PRESETS["gpt3-175b"], Cluster(nodes=128, **H100_NODE), global_batch_size=2048)
    long = make_plan(replace(PRESETS["llama2-70b"], seq_len=4096), Cluster(nodes=128, **H100_NODE), 1024)
    for plan in (big, long):
        assert 0 < plan.costed == len(plan.ranked) <= plan.considered <= 4000
        assert plan.costed <= 500


def test_cli_table_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "llama-1b", "--nodes", "1", "--global-batch-size", "256"]
    assert plan_main(args + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "why: tp=1 pp=1 dp=8" in out and out.count("\n") > 5
    assert plan_main(args + ["--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layouts"]) == 2 and data["layouts"][0]["layout"]["tp"] == 1
    assert plan_main(["--preset", "llama-7b", "--gpus-per-node", "2", "--gpu-memory-gb", "16",
                      "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the model") and err.count("\n") == 1
    assert plan_main(args + ["--zero-stages", "5"]) == 2
    assert "--zero-stages" in capsys.readouterr().err


# ------------------------------------------------------------------ the text table and the JSON agree

_COLUMNS = ("#", "tp", "cp", "pp", "dp", "zero", "vpp", "mbs", "M", "recomp", "step s", "MFU", "HFU", "bubble",
            "mem GB", "states", "rest", "TP GB", "CP GB", "PP GB", "DP GB")


_STATES = ("parameters", "gradients", "master weights", "optimizer states", "ZeRO-3 gather buffers", "gloo staging")


def _json_row(i: int, d: dict) -> list[str]:
    """What the text table must print for JSON layout `d` (rank i), at the table's precision."""
    lay, peak, cb = d["layout"], d["peak_memory"], d["comm_bytes"]
    return [str(i), str(lay["tp"]), str(lay["cp"]), str(lay["pp"]), str(lay["dp"]), str(lay["zero"]), str(lay["vpp"]),
            str(lay["micro_batch_size"]), str(d["num_microbatches"]), lay["recompute"],
            f"{d['step_seconds']:.3f}", f"{d['mfu']:.1%}", f"{d['hfu']:.1%}", f"{d['bubble']:.1%}",
            f"{peak['total'] / GB:.1f}", f"{sum(peak['terms'][k] for k in _STATES) / GB:.1f}",
            f"{(peak['total'] - sum(peak['terms'][k] for k in _STATES)) / GB:.1f}",
            f"{cb.get('tp', 0.0) / GB:.2f}", f"{cb.get('cp', 0.0) / GB:.2f}",
            f"{d['pp_bytes_with_embedding'] / GB:.2f}",
            f"{cb.get('dp', 0.0) / GB:.2f}"]


@pytest.mark.parametrize("args", [
    ["--preset", "llama-1b", "--nodes", "1", "--global-batch-size", "256"],
    ["--preset", "gpt3-175b", "--nodes", "128", "--global-batch-size", "1536", "--device", "A100",
     "--intra-gbytes", "300", "--inter-gbps", "200", "--compare", "tp=8,pp=8"],
    ["--preset", "llama-7b", "--seq-len", "65536", "--nodes", "2", "--global-batch-size", "8", "--cp", "1,2,4",
     "--compare", "tp=8,cp=2"],
])
def test_json_and_text_agree_on_every_field(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(args + ["--top", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert plan_main(args + ["--top", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "tp"])
    assert lines[header].split() == " ".join(_COLUMNS).split()  # the columns _json_row fills, in order
    rows = [line.split() for line in lines[header + 1:header + 7]]
    assert len(rows) == len(data["layouts"]) == 6
    for i, (row, d) in enumerate(zip(rows, data["layouts"]), 1):
        assert row == _json_row(i, d), (row, _json_row(i, d))
        # The one step time that is ranked: DP overlapped; the other is named as such.
        assert d["step_seconds"] <= d["step_seconds_no_overlap"]
        assert d["mfu"] >= d["mfu_no_overlap"]
    assert f"why: {data['why']}" in lines
    for comp in data["comparisons"]:
        assert f"compare {comp['explanation']}" in lines


# ------------------------------------------------------------------ explanations name what differs

def test_tie_between_micro_batches_names_the_rule_and_the_memory() -> None:
    # One node, plain data parallelism wins; layouts differing only in micro-batch size cost the same
    # time (no bubble, the same FLOPs and traffic), so the tie-break decides, and must say so.
    plan = make_plan(PRESETS["llama-1b"], Cluster(nodes=1, **H100_NODE), global_batch_size=256)
    best, second = plan.ranked[0], plan.ranked[1]
    assert differences(best.layout, second.layout).startswith("mbs ")
    assert "mbs" in plan.why and "dp largest" not in plan.why
    assert f"winner vs it: {differences(best.layout, second.layout)}" in plan.why
    assert "the larger micro-batch" in plan.why
    # The larger micro-batch holds more activations: the price is spelled out.
    assert best.layout.micro_batch_size > second.layout.micro_batch_size
    more = (best.memory - second.memory) / GB
    assert more > 1 and f"at {more:.1f} GB more memory per GPU" in plan.why
    assert len(RULES) == len(_rules_key(best))


def test_compare_explains_the_ranking_against_megatron_tp8_pp8() -> None:
    # GPT-3 175B on 1024 A100s (80 GB), batch 1536: Megatron-LM trained this size with tp=8 x pp=8.
    a100 = dict(gpus_per_node=8, gpu_memory_bytes=80 * GB, intra_bytes_per_s=300 * GB,
                inter_bytes_per_s=25 * GB, peak_flops=312e12)
    plan = make_plan(PRESETS["gpt3-175b"], Cluster(nodes=128, **a100), global_batch_size=1536)
    comp = compare(plan, "tp=8,pp=8")
    assert comp.fits and comp.rank is not None and comp.rank > 1
    cand = comp.candidate
    assert (cand.layout.tp, cand.layout.pp) == (8, 8)
    assert plan.ranked[comp.rank - 1] is cand  # the best tp=8 pp=8 variant the search costed
    assert all((c.layout.tp, c.layout.pp) != (8, 8) for c in plan.ranked[:comp.rank - 1])
    slower = cand.step_seconds / plan.ranked[0].step_seconds - 1
    assert f"{slower:.1%} slower" in comp.explanation and "winner vs it: tp " in comp.explanation
    # A spelled-out layout the search pruned is costed as given; one that does not fit says so.
    exact = compare(plan, "tp=8,pp=8,zero=0,recompute=full,mbs=1,vpp=1")
    assert exact.rank is None and exact.candidate.layout.recompute == "full"
    assert compare(plan, "tp=2,pp=1,zero=0").fits is False
    assert "does not fit" in compare(plan, "tp=2,pp=1,zero=0").explanation
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        compare(plan, "tensor=8")
    # Published layouts by name: `megatron` is tp=8 x pp=8 and says where it comes from.
    named = compare(plan, "megatron")
    assert named.candidate is cand and named.explanation.startswith("megatron (Megatron-LM")


@pytest.mark.parametrize("bad", [["--nodes", "0"], ["--gpu-memory-gb", "-80"], ["--top", "0"],
                                 ["--memory-fraction", "1.5"], ["--global-batch-size", "x"],
                                 ["--compare", "tp=eight"], ["--compare", "tp=3,pp=1"]])
def test_plan_bad_values_are_one_line_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "llama-1b", "--nodes", "1", "--global-batch-size", "256"]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(plan_main(args + bad))
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: ") and out.err.count("\n") == 1, out.err


def test_zero_bubble_schedules_are_ranked_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """With --schedules including zb-h1/zbv the planner costs them beside 1F1B/interleaved: a zero-bubble layout
    is never slower than its 1F1B twin (same split, batch, ZeRO, recompute: a smaller bubble, no less memory),
    zbv only appears for untied embeddings, and the text names the schedule. Not asked: none appear."""
    dims = PRESETS["llama-7b"]
    cluster = Cluster(nodes=4, **H100_NODE)
    default = make_plan(dims, cluster, global_batch_size=64)
    assert {c.layout.schedule for c in default.ranked} <= {"1f1b", "interleaved"}
    plan = make_plan(dims, cluster, global_batch_size=64,
                     search=Search(schedules=("1f1b", "interleaved", "zb-h1", "zbv")))
    by_layout = {replace(c.layout, schedule="1f1b"): c for c in plan.ranked if c.layout.schedule == "1f1b"}
    zb = [c for c in plan.ranked if c.layout.schedule == "zb-h1"]
    assert zb and any(c.layout.schedule == "zbv" for c in plan.ranked)
    for c in zb:
        twin = by_layout.get(replace(c.layout, schedule="1f1b"))
        if twin is not None:
            assert c.est.bubble < twin.est.bubble and c.step_seconds <= twin.step_seconds
            # Every rank holds P micro-batches (1F1B: P - r), so the worst stage holds at least 1F1B's.
            assert c.memory >= twin.memory
    gpt2 = make_plan(replace(dims, arch="gpt2", tie_embeddings=True), cluster, global_batch_size=64,
                     search=Search(schedules=("1f1b", "zbv")))
    assert all(c.layout.schedule != "zbv" for c in gpt2.ranked)
    assert plan_main(["--preset", "llama-7b", "--nodes", "4", "--global-batch-size", "64",
                      "--schedules", "1f1b,zb-h1", "--json"]) == 0
    assert "zb-h1" in {d["layout"]["schedule"] for d in json.loads(capsys.readouterr().out)["layouts"]}
    assert plan_main(["--preset", "llama-7b", "--nodes", "4", "--global-batch-size", "64",
                      "--schedules", "1f1b,zb"]) == 2


# ------------------------------------------------------------------ context parallelism

LONG = replace(PRESETS["llama-7b"], seq_len=524288)


def test_cp_is_ranked_when_asked_and_only_then() -> None:
    """`cp_sizes=(1, 2, 4)`: every candidate uses all the GPUs (tp x cp x pp x dp) and fits; the memory is
    the peak model's; a 512K-token 7B sequence needs cp, so every fitting layout has cp > 1. cp = 1 alone:
    the same sequence fits nowhere, and the error says so."""
    cluster = Cluster(nodes=2, **H100_NODE)
    plan = make_plan(LONG, cluster, global_batch_size=8, search=Search(cp_sizes=(1, 2, 4)))
    assert plan.ranked and {c.layout.cp for c in plan.ranked} <= {2, 4}
    for c in plan.ranked[:20]:
        lay = c.layout
        assert lay.tp * lay.cp * lay.pp * lay.dp == cluster.world
        assert worst_stage_memory(LONG, lay, Precision()) <= cluster.memory_limit
        assert c.est.comm_bytes["cp"] > 0
    with pytest.raises(ConfigError, match="fits on no layout of 16 GPUs"):
        make_plan(LONG, cluster, global_batch_size=8, search=Search(cp_sizes=(1,)))
    short = make_plan(PRESETS["llama-7b"], cluster, global_batch_size=64)  # 4K tokens fit: cp is never tried
    assert {c.layout.cp for c in short.ranked} == {1} and "context parallelism" not in short.why


def test_cp_is_tried_automatically_when_a_sequence_fits_nowhere(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = Cluster(nodes=2, **H100_NODE)
    plan = make_plan(LONG, cluster, global_batch_size=8)  # cp_sizes=None: automatic
    assert auto_cp_sizes(LONG, cluster) == (2, 4, 8, 16)
    assert plan.why.startswith("no layout fits at cp = 1, so context parallelism was tried (cp = 2, 4, 8, 16)")
    asked = make_plan(LONG, cluster, global_batch_size=8, search=Search(cp_sizes=(2, 4, 8, 16)))
    assert [c.layout for c in plan.ranked] == [c.layout for c in asked.ranked]
    assert "cp=" in plan.why  # describe() names cp when it is > 1
    args = ["--preset", "llama-7b", "--seq-len", "524288", "--nodes", "2", "--global-batch-size", "8", "--top", "3"]
    assert plan_main(args) == 0
    assert "context parallelism was tried" in capsys.readouterr().out
    assert plan_main(args + ["--cp", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: the model")
    assert plan_main(args + ["--cp", "0,2"]) == 2
    assert "--cp" in capsys.readouterr().err


def test_a_ring_beyond_a_node_uses_the_network() -> None:
    """tp x cp ranks within a node: the ring runs at NVLink speed; across nodes, at the network's."""
    cluster = Cluster(nodes=2, **H100_NODE)
    plan = make_plan(replace(LONG, seq_len=65536), cluster, global_batch_size=8, search=Search(cp_sizes=(2, 4)))
    inside = next(c for c in plan.ranked if c.layout.tp * c.layout.cp <= 8)
    across = next(c for c in plan.ranked if c.layout.tp * c.layout.cp > 8)
    for c, speed in ((inside, H100_NODE["intra_bytes_per_s"]), (across, H100_NODE["inter_bytes_per_s"])):
        assert c.est.comm_seconds["cp"] == pytest.approx(c.est.comm_bytes["cp"] / speed, rel=1e-12)
