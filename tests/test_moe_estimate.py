"""The estimator's MoE numbers: published total/active parameter counts, the balanced all-to-all bytes against
the measured-routing formula, and tools/estimate.py's MoE section. (Measured 'ep' bytes of real runs equal
`a2a_bytes_measured` of their routing: tests/test_moe_ep.py.)"""

from __future__ import annotations

import pytest

from megalite.moe.costs import a2a_bytes_balanced, a2a_bytes_measured
from megalite.perfmodel.inputs import Layout, Precision
from megalite.perfmodel.moe import moe_estimate, moe_param_counts, moe_preset_model


def _model(preset: str):
    return moe_preset_model(preset)


def test_mixtral_8x7b_counts_match_the_published_46_7b_total_12_9b_active() -> None:
    c = moe_param_counts(_model("mixtral-8x7b"))
    assert round(c.total / 1e9, 1) == 46.7 and round(c.active / 1e9, 1) == 12.9  # Jiang et al. 2024


def test_balanced_bytes_equal_the_measured_formula_at_balanced_routing() -> None:
    tokens, k, e, h, ep = 64, 2, 8, 16, 4
    off = 2 * tokens * k * (ep - 1) // ep  # sent + received off-rank rows when every rank gets 1/ep
    assert a2a_bytes_balanced(tokens, k, e, h, ep, 4) == a2a_bytes_measured(off, 1, ep, e, h, 4)
    assert a2a_bytes_balanced(tokens, k, e, h, 1, 4) == 0


def test_experts_and_their_states_split_over_ep_and_edp() -> None:
    m = _model("mixtral-8x7b")
    one = moe_estimate(m, Layout(dp=8, zero=1), 1, Precision())
    eight = moe_estimate(m, Layout(dp=8, zero=1), 8, Precision())
    assert eight.expert_params_per_rank * 8 == one.expert_params_per_rank
    assert eight.memory.params < one.memory.params and one.ep_bytes_per_step == 0 < eight.ep_bytes_per_step


def test_tools_estimate_prints_the_moe_section(capsys) -> None:
    from tools.estimate import main

    assert main(["--preset", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "46.703 B total, 12.880 B active" in out and "GB per step per rank ('ep')" in out


@pytest.mark.parametrize("source", [["--preset", "tiny-moe"], ["--model.preset", "tiny-moe"]])
def test_estimate_peak_rows_of_a_moe_model_are_the_check_before_step_1s(source: list[str], capsys) -> None:
    """`tools/estimate.py`'s peak for a MoE preset or config sizes its experts (their weights, states, routed rows)
    exactly as the check before step 1 does for the same run, not the dense model the flags' MLP width gives."""
    import json

    from megalite.config import parse_args, resolve
    from megalite.training.memory_check import predicted_peak
    from tools.estimate import main

    flags = ["--memory-device", "cpu", "--dtype", "fp32", "--micro-batch-size", "8", "--json"]
    assert main(source + flags) == 0
    peak = json.loads(capsys.readouterr().out)["peak_memory"]
    cfg = resolve(parse_args(["--model.preset", "tiny-moe", "--train.device", "cpu"]), 1)
    cfg.model.vocab_size = 2048  # the demo tokenizer's, as the estimate assumes
    assert peak["terms"] == pytest.approx(predicted_peak(cfg).to_dict()["terms"], rel=1e-12)


def test_tools_estimate_moe_from_flags_and_configs_and_refusals(capsys) -> None:
    """The MoE section honours the model flags over a preset (--num-layers), reads a pretrain config's model and
    parallel.ep (the run's own flags), prices a measured load imbalance, and refuses --ep on a dense model and
    an impossible load with one line (exit 2)."""
    import json

    from tools.estimate import main

    def moe(*argv: str) -> dict:
        assert main([*argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["moe"]

    full, four = moe("--preset", "mixtral-8x7b", "--dp", "8"), moe("--preset", "mixtral-8x7b", "--dp", "8",
                                                                   "--num-layers", "4")
    per_layer = (full["params_total"] - four["params_total"]) / 28  # the 28 layers --num-layers 4 removed
    assert round(four["params_total"] - 4 * per_layer) == round(full["params_total"] - 32 * per_layer)
    from megalite.perfmodel.moe import moe_preset_model  # what tools/plan.py prices: the flags win there too

    assert moe_preset_model("mixtral-8x7b", {"num_layers": 4, "seq_len": 512, "hidden_size": None}).num_layers == 4
    run = moe("--model.preset", "tiny-moe", "--parallel.ep", "2", "--dp", "2")  # a pretrain run's flags
    assert run["ep_bytes_per_step"] > 0 and run["params_total"] > run["params_active"]
    assert moe("--model.preset", "tiny-moe", "--dp", "2")["ep_bytes_per_step"] == 0  # ep 1
    # One expert per rank (tiny-moe: 8 experts, ep 8): the busiest rank takes exactly max/mean x the rows, and
    # sends back all it got: 2 (1 + f) of the balanced 4 x rows x h x b per layer.
    skew = moe("--preset", "tiny-moe", "--dp", "8", "--ep", "8", "--moe-load-imbalance", "1.5")
    assert skew["busiest_factor"] == 1.5 and skew["expert_flops_per_step"] > 0
    counts = 7 * 1 * 8  # (ep - 1) x E/ep int64 counts per layer and micro-batch
    n = skew["ep_bytes_per_step"] / skew["a2a_bytes_per_layer"]  # layer-micro-batches per step
    rows_bytes = skew["a2a_bytes_per_layer"] - counts  # balanced: 4 x rows x h x b
    assert skew["ep_bytes_per_step_busiest"] == pytest.approx(n * (rows_bytes * 2 * (1 + 1.5) / 4 + counts))
    assert moe("--preset", "tiny-moe", "--dp", "8", "--ep", "8", "--moe-load-imbalance", "20")["busiest_factor"] == 8
    # Muon on the experts: tiny-moe's 4 layers x 8 experts of (128 x 128) gate, up, down, 4 per rank at ep 2,
    # owned over edp 2 under ZeRO-1: 4 x 3 x ns_flops(128, 128) / 2 per rank.
    from megalite.perfmodel.muon import ns_flops

    mu = moe("--preset", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "1", "--optimizer", "muon")["muon_experts"]
    assert mu["ns_flops_per_rank"] == 4 * 4 * 3 * ns_flops(128, 128) / 2 and mu["dp_bytes_per_rank_bound"] > 0
    for argv, words in [(["--preset", "llama-1b", "--dp", "2", "--ep", "2"], "--ep 2 needs a mixture-of-experts"),
                        (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--moe-load-imbalance", "0.5"],
                         "is impossible")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err and "Traceback" not in err, err


def test_planner_ranks_ep_and_says_when_the_all_to_all_crosses_nodes(capsys) -> None:
    """tools/plan.py on a MoE preset enumerates ep with the other dimensions; an ep group crosses the node
    boundary exactly when tp x ep exceeds the GPUs per node (rank order tp, cp, dp, pp), read from the rank
    grid, and then its all-to-all is priced at the network's bandwidth."""
    import json

    from tools.plan import main

    assert main(["--preset", "qwen3-30b-a3b", "--seq-len", "1024", "--nodes", "2", "--gpus-per-node", "4",
                 "--global-batch-size", "32", "--gpu-memory-gb", "80", "--top", "1000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = plan["layouts"]
    assert {r["ep"] for r in rows} == {1, 2, 4, 8} and "all-to-all" in plan["why"]
    intra, inter = plan["cluster"]["intra_bytes_per_s"], plan["cluster"]["inter_bytes_per_s"]
    for r in rows:
        crosses = r["layout"]["tp"] * r["ep"] > 4
        assert r["a2a_crosses_nodes"] == crosses, r
        assert r["a2a_seconds"] == pytest.approx(r["a2a_bytes"] / (inter if crosses else intra))
        assert (r["a2a_bytes"] == 0) == (r["ep"] == 1) and r["memory"] <= 0.9 * 80 * 2**30
    assert any(r["a2a_crosses_nodes"] for r in rows) and any(not r["a2a_crosses_nodes"] and r["ep"] > 1 for r in rows)
    # What the MoE search does not do is refused, not silently dropped (one line, exit 2).
    assert main(["--preset", "tiny-moe", "--global-batch-size", "8", "--compare", "tp=2", "--cp", "1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compare and --cp not supported for a MoE model" in err and "\n" not in err, err


def test_ep_groups_cross_nodes_as_the_rank_grid_says() -> None:
    from megalite.perfmodel.estimate import Layout
    from megalite.perfmodel.moe_plan import ep_crosses_nodes

    assert not ep_crosses_nodes(Layout(tp=2, dp=8), 4, 8) and ep_crosses_nodes(Layout(tp=2, dp=8), 8, 8)
    assert not ep_crosses_nodes(Layout(cp=2, dp=4), 4, 4)   # ep from the cp x dp digits: 4 consecutive ranks
    assert ep_crosses_nodes(Layout(tp=2, cp=2, dp=2), 4, 4)  # tp x ep = 8 ranks over nodes of 4
    assert not ep_crosses_nodes(Layout(dp=2, pp=4), 2, 2)   # pp is outermost: each stage's ep group is local


def test_deepseek_v3_memory_at_its_published_layout() -> None:
    """DeepSeek-V3's pre-training layout (Liu et al. 2024, section 3.2: 2048 H800 of 80 GB, PP16, EP64 over 8
    nodes, ZeRO-1 DP, no TP; sequences of 4096, batch 15360) in megalite's estimator: the numbers docs/moe.md
    states: the peak model of its worst stage (the first under selective recompute, the last, with the logits and
    the MTP module's weights, under full), with MLA's and the MTP module's parameters."""
    from megalite.perfmodel.estimate import Layout
    from megalite.perfmodel.moe import moe_preset_model
    from megalite.perfmodel.moe_plan import ep_crosses_nodes, moe_memory

    m = moe_preset_model("deepseek-v3")
    gb = {}
    for rc in ("selective", "full"):
        lay = Layout(tp=1, pp=16, dp=128, zero=1, micro_batch_size=1, global_batch_size=15360, recompute=rc)
        states, acts = moe_memory(m, lay, 64, Precision())
        gb[rc] = (round(states / 1e9, 1), round((states + acts) / 1e9, 1))
    assert gb == {"selective": (13.7, 119.8), "full": (21.3, 32.8)}
    assert ep_crosses_nodes(lay, 64, 8)
