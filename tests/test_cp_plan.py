"""The planner's cp-mode ranking (megalite/perfmodel/cp_plan.py): every mode the heads allow, fastest fitting
first, hybrid's all-to-all priced on NVLink when its tp x cp_a2a ranks fit a node, and tools/plan.py saying why.
Pure arithmetic on the estimator: exact comparisons, no tolerance beyond float rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.perfmodel.cp_plan import mode_layouts, rank_cp_modes
from megalite.perfmodel.estimate import PRESETS, Layout, Precision
from megalite.perfmodel.plan import Cluster, cost

GB = 1e9
# 2 nodes of 8 H100-class GPUs: NVLink 450 GB/s inside a node, 50 GB/s across.
CLUSTER = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=80 * GB, intra_bytes_per_s=450 * GB,
                  inter_bytes_per_s=50 * GB, peak_flops=989e12)


def test_modes_follow_the_heads() -> None:
    dims = replace(PRESETS["llama-7b"], seq_len=65536)  # 32 heads = kv heads
    modes = [(lay.cp_mode, lay.cp_a2a) for lay in mode_layouts(dims, Layout(tp=8, cp=8, sp=True))]
    assert modes == [("ring", 1), ("allgather", 1), ("hybrid", 2), ("hybrid", 4)]  # 4 heads per tp rank: no a2a
    gqa = replace(PRESETS["llama2-70b"], seq_len=65536)  # 1 kv head per tp rank at tp = 8: ring and allgather only
    assert [lay.cp_mode for lay in mode_layouts(gqa, Layout(tp=8, cp=4, sp=True))] == ["ring", "allgather"]


def test_ranking_prices_hybrids_all_to_all_inside_a_node() -> None:
    """tp 2 x cp 8 spans both nodes: the ring crosses the network, hybrid's 4-rank all-to-all (tp x 4 = 8 GPUs)
    stays on NVLink. The ranking is by step time, and the hybrid's time is the estimator's with only its
    all-to-all re-priced (so it is at most the same layout priced wholly at the network's speed)."""
    dims = replace(PRESETS["llama-7b"], seq_len=32768)
    base = Layout(tp=2, cp=8, sp=True, recompute="full", global_batch_size=1, zero=1)
    ranking = rank_cp_modes(dims, base, CLUSTER, Precision())
    assert all(m.fits for m in ranking.ranked)
    times = [m.step_seconds for m in ranking.ranked]
    assert times == sorted(times) and len(ranking.ranked) == 5  # ring, allgather, a2a, hybrid 2, hybrid 4
    hybrid4 = next(m for m in ranking.ranked if m.layout.cp_mode == "hybrid" and m.layout.cp_a2a == 4)
    network = cost(dims, hybrid4.layout, CLUSTER, Precision())
    assert hybrid4.step_seconds < network.step_seconds  # the all-to-all at 450, not 50 GB/s
    assert hybrid4.cp_bytes == network.est.comm_bytes["cp"]  # bytes unchanged: only their speed
    best = ranking.ranked[0]
    assert ranking.explanation.startswith(f"cp mode: {best.label} is fastest (") and "because" in ranking.explanation


def test_tools_plan_prints_the_cp_mode_ranking(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.plan import main

    assert main(["--preset", "llama-7b", "--seq-len", "131072", "--nodes", "4", "--global-batch-size", "16",
                 "--cp", "2,4", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "\ncompare cp mode: " in out and " is fastest (" in out and "because" in out
