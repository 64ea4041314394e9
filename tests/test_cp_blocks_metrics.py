"""metrics.jsonl's `cp_blocks`: a windowed cp=2 ring pretrain run (its entry point in the session's warm ranks,
tests/pool_pretrain.py) reports the chunk pairs its ring computed and skipped, exactly what attention/costs.py's
`ring_blocks_total` predicts; the field is absent where no ring runs (megalite/training/reporting.py `cp_blocks`).

Counting convention (context/ring.py, reporting.py): one count per ring *forward* call, on every rank, summed over
the cp group: per step, layers x micro-batches x `ring_blocks_total` of the layer's window. The backward visits the
same pairs and is not counted; with recompute=none (this run) no forward runs twice."""

from __future__ import annotations

import json
from pathlib import Path

from megalite.attention.costs import ring_blocks_total
from megalite.parallel.state import ParallelState
from megalite.training.reporting import cp_blocks
from tests.pool_pretrain import run_pretrain_in_pool
from tests.test_pretrain import _args

SEQ, CP, WINDOW, MICRO_BATCHES = 32, 2, 4, 2


def test_windowed_ring_run_reports_its_computed_and_skipped_blocks(dist_world, demo_cache_dir: str,
                                                                   tmp_path: Path) -> None:
    # One sliding layer (W = 4) and one full one; chunks of S / (2 cp) = 8 tokens, so the windowed layer sees only
    # the chunk before its own and skips the pairs two chunks apart and further.
    proc = run_pretrain_in_pool(dist_world, _args(
        demo_cache_dir, tmp_path, "--train.steps", "2", "--parallel.cp", str(CP), "--model.seq_len", str(SEQ),
        "--model.layer_types", "sliding_attention,full_attention", "--model.sliding_window", str(WINDOW),
        "--train.global_batch_size", str(4 * MICRO_BATCHES)), nproc=CP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    windowed, full = ring_blocks_total(SEQ, CP, WINDOW), ring_blocks_total(SEQ, CP)
    assert (windowed.computed, windowed.skipped, full.computed, full.skipped) == (7, 3, 10, 0)  # by hand: 10 pairs
    expected = {"computed": MICRO_BATCHES * (windowed.computed + full.computed),
                "skipped": MICRO_BATCHES * (windowed.skipped + full.skipped)}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # per step: the counter starts each step at zero
        assert row["cp_blocks"] == expected, f"step {row['step']}: {row['cp_blocks']} != {expected}"


def test_no_ring_no_field() -> None:
    """One process, or a cp mode without a ring, reports no `cp_blocks` (and runs no collective for it)."""
    tallies = {"cp_blocks_computed": 5, "cp_blocks_skipped": 1}
    assert cp_blocks(ParallelState(), "ring", tallies) is None
    assert cp_blocks(ParallelState(cp=2), "allgather", tallies) is None
    assert cp_blocks(ParallelState(cp=2), "a2a", tallies) is None
