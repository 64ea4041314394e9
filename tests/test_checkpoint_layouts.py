"""Checkpoint layout changes end to end: `pretrain.py`'s entry point at N ranks, fp32, gloo on CPU.

For each pair (A, B): an uninterrupted 6-step run at layout A saves at step 3 (and at the end); a new job
at layout B loads A's step-3 checkpoint and trains steps 4..6. Its losses must equal A's steps 4..6 and
its final data position (the sampler's consumed_samples in the step-6 checkpoint) must equal A's: the
resumed job read exactly the samples A read, none skipped, none repeated (a wrong data position moves
the loss by ~1e-2, far outside the tolerance below).

Save at (tp2, pp2, dp2, zero1), continue at (tp1, pp4, dp2, zero3) runs at 8 ranks in
`test_issue_targets_at_8_ranks`; the other pairs use 4 ranks. Each job runs in the session's warm ranks of its
world size (tests/pool_pretrain.py: the same entry point after the rendezvous, without N + 1 torch start-ups per
job); each job rebuilds everything from its config and the checkpoint on disk. Resuming in fresh processes
under torchrun is tests/test_reliability.py's killed-rank restart and tests/test_async_save.py's kill -9.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import SMALL_RUN
from tests.dist_harness import DistWorld
from tests.pool_pretrain import PoolRun, run_pretrain_in_pool
from tools.reshard_checkpoint import main as reshard_main

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8
# Layouts change the order of the same fp32 sums: TP splits matmuls into partial sums, dp/ZeRO reduce
# gradients in a different order (all-reduce vs reduce-scatter over 1, 2 or 4 ranks), micro-batch
# counts differ, and the grad-norm is summed per stage. That is ~1e-7 relative per op on a loss of ~6;
# Adam can amplify it where a gradient is near zero (the update is ~ sign(g)). Measured: every pair here
# differs by 0 or 1.2e-7 (one ulp of a loss near 6) over steps 4..6; 1e-5 leaves room for longer
# amplification. Resuming one batch further on (consumed_samples + 8) moved the losses by 4e-3..3e-2,
# and a missing slice of a tensor moves them by > 1e-3, so the tolerance still catches both.
LOSS_ATOL = 1e-5

Layout = dict[str, object]


def _flags(lay: Layout) -> list[str]:
    return ["--parallel.tp", str(lay["tp"]), "--parallel.pp", str(lay["pp"]), "--parallel.dp", str(lay["dp"]),
            "--parallel.sp", str(lay.get("sp", False)).lower(), "--parallel.zero", str(lay["zero"])]


def _world(lay: Layout) -> int:
    return int(lay["tp"]) * int(lay["pp"]) * int(lay["dp"])


def _train(dist_world: Callable[[int], DistWorld], lay: Layout, args: list[str]) -> PoolRun:
    proc = run_pretrain_in_pool(dist_world, [*args, *_flags(lay)], _world(lay))
    assert proc.returncode == 0, f"{lay}: {proc.stderr[-3000:]}"
    return proc


def _losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _consumed(step_dir: Path) -> int:
    return int(json.loads((step_dir / "index.json").read_text())["extra"]["sampler"]["consumed_samples"])


def _common(cache: str) -> list[str]:
    # micro-batch 2 so every layout here (dp 1..4, pp 1..2) has >= pp micro-batches per step.
    return ["--data.cache_dir", cache, *SMALL_RUN, "--train.micro_batch_size", "2", "--train.global_batch_size",
            str(GLOBAL_BATCH), "--train.steps", str(STEPS), "--train.dtype", "fp32", "--train.device", "cpu"]


# tp, pp and dp all changing at once is the 8-rank test's (below); moving between ZeRO stages at one layout,
# every pair of stages, is tests/test_zero_checkpoint.py's (in-process, no launcher).
PAIRS = [  # (A, B, reshard offline first with these tool flags, or None)
    # tp 2 + sequence parallel -> tp 1; dp 2 -> 4; ZeRO 1 -> 3
    ({"tp": 2, "pp": 1, "dp": 2, "sp": True, "zero": 1}, {"tp": 1, "pp": 1, "dp": 4, "zero": 3}, None),
    # pp 2 -> 1, tp 1 -> 2 with sp, ZeRO 2 -> 3, through tools/reshard_checkpoint.py to the target tp first
    ({"tp": 1, "pp": 2, "dp": 2, "zero": 2}, {"tp": 2, "pp": 1, "dp": 2, "sp": True, "zero": 3}, ["--tp", "2"]),
]


@pytest.mark.parametrize("a,b,tool", PAIRS, ids=["tp2sp-z1-dp4z3", "pp2z2-tool-tp2sp-z3"])
def test_continue_at_another_layout(dist_world, demo_cache_dir: str, tmp_path: Path, a: Layout, b: Layout,
                                    tool: list[str] | None) -> None:
    common = _common(demo_cache_dir)
    _train(dist_world, a, [*common, "--logging.dir", str(tmp_path / "log_a"), "--checkpoint.dir",
                           str(tmp_path / "ck_a"), "--checkpoint.interval", str(SAVE_AT)])
    saved = tmp_path / "ck_a" / f"step_{SAVE_AT:08d}"
    assert _consumed(saved) == SAVE_AT * GLOBAL_BATCH
    load = saved
    if tool is not None:
        load = tmp_path / "resharded"
        # in this process (its command line runs as a script in tests/test_bad_inputs_checkpoint.py)
        assert reshard_main(["--input", str(saved), "--output", str(load), "--quiet", *tool]) == 0
        assert _consumed(load) == SAVE_AT * GLOBAL_BATCH  # the tool carries the data position over
    out = _train(dist_world, b, [*common, "--logging.dir", str(tmp_path / "log_b"), "--checkpoint.dir",
                                 str(tmp_path / "ck_b"), "--checkpoint.load", str(load)])
    assert f"resumed from {load} at step {SAVE_AT}" in out.stdout
    want, got = _losses(tmp_path / "log_a"), _losses(tmp_path / "log_b")
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1)), sorted(got)
    diffs = {s: abs(got[s] - want[s]) for s in got}
    assert max(diffs.values()) <= LOSS_ATOL, (diffs, got, want)
    end = f"step_{STEPS:08d}"
    assert _consumed(tmp_path / "ck_b" / end) == _consumed(tmp_path / "ck_a" / end) == STEPS * GLOBAL_BATCH


def test_issue_targets_at_8_ranks(dist_world, demo_cache_dir: str, tmp_path: Path) -> None:
    """Save at (tp2, pp2, dp2, zero1); continue at (tp1, pp4, dp2, zero3). (Continuing at tp4 is the same
    loader growing tp, which tests/test_checkpoint_reshard.py holds in-process, tp1 -> tp4, at a fraction of
    an 8-rank torchrun job's start-up.)"""
    batch = 16  # micro-batch 2 x dp 2 x 4 micro-batches: enough for pp=4
    common = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--model.num_layers", "4", "--model.num_kv_heads", "4",
              "--train.micro_batch_size", "2", "--train.global_batch_size", str(batch), "--train.steps", str(STEPS),
              "--train.dtype", "fp32", "--train.device", "cpu"]
    a = {"tp": 2, "pp": 2, "dp": 2, "zero": 1}
    _train(dist_world, a, [*common, "--logging.dir", str(tmp_path / "log_a"), "--checkpoint.dir",
                           str(tmp_path / "ck_a"), "--checkpoint.interval", str(SAVE_AT)])
    saved = tmp_path / "ck_a" / f"step_{SAVE_AT:08d}"
    want = _losses(tmp_path / "log_a")
    for name, b in (("pp4z3", {"tp": 1, "pp": 4, "dp": 2, "zero": 3}),):
        _train(dist_world, b, [*common, "--logging.dir", str(tmp_path / name), "--checkpoint.dir",
                               str(tmp_path / f"ck_{name}"), "--checkpoint.load", str(saved)])
        got = _losses(tmp_path / name)
        assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1)), (name, sorted(got))
        diffs = {s: abs(got[s] - want[s]) for s in got}
        assert max(diffs.values()) <= LOSS_ATOL, (name, diffs)
        assert _consumed(tmp_path / f"ck_{name}" / f"step_{STEPS:08d}") == STEPS * batch
