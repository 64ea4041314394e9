"""End to end: `pretrain.py --parallel.cp 2 --parallel.tp 2 --parallel.sp true` at 4 ranks (its entry point in
the session's warm ranks, tests/pool_pretrain.py) trains like one process (metrics.jsonl losses), logs the cp, tp
and dp bytes and model-state bytes the estimator predicts (exactly), and checkpoints move between cp=2 and cp=1
runs in both directions with the same next-step loss.

Tolerance: fp32, the same math in another summation order (tests/test_cp_training.py): 1e-5 on O(1) losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain import main
from tests.test_estimate_cp import assert_run_equals_estimate
from tests.pool_pretrain import run_pretrain_in_pool
from tests.test_pretrain import _args, _losses

TOL = 1e-5


def _last_row(log_dir: Path) -> dict:
    return json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_cp2_tp2_sp_matches_single_process_and_checkpoints_cross(
        dist_world, demo_cache_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ["--checkpoint.interval", "2", "--checkpoint.keep", "2"]
    one_dir, cp_dir = tmp_path / "one", tmp_path / "cp"
    assert main(_args(demo_cache_dir, one_dir, "--train.steps", "3", "--checkpoint.dir", str(tmp_path / "ck_one"),
                      *ckpt)) == 0
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, cp_dir, "--train.steps", "3", "--checkpoint.dir",
                                                  str(tmp_path / "ck_cp"), *ckpt, "--parallel.cp", "2", "--parallel.tp",
                                                  "2", "--parallel.sp", "true"), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, cp = _losses(one_dir), _losses(cp_dir)
    assert sorted(one) == sorted(cp) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - cp[step]) < TOL, f"step {step}: cp=2 tp=2 loss {cp[step]} != {one[step]}"
    assert_run_equals_estimate(cp_dir, capsys)
    # The cp run's step-2 checkpoint resumed by one process, and the reverse (cp = 2 alone, 2 ranks).
    resume_one = tmp_path / "resume_one"
    assert main(_args(demo_cache_dir, resume_one, "--train.steps", "3", "--checkpoint.load",
                      str(tmp_path / "ck_cp" / "step_00000002"), "--checkpoint.dir", str(tmp_path / "ck_r1"))) == 0
    resume_cp = tmp_path / "resume_cp"
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, resume_cp, "--train.steps", "3", "--checkpoint.load",
                                                  str(tmp_path / "ck_one" / "step_00000002"), "--checkpoint.dir",
                                                  str(tmp_path / "ck_r2"), "--parallel.cp", "2"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, log in (("cp=2 checkpoint at cp=1", resume_one), ("cp=1 checkpoint at cp=2", resume_cp)):
        resumed = _losses(log)
        assert list(resumed) == [3], f"{name}: resumed steps {list(resumed)}"
        assert abs(resumed[3] - one[3]) < TOL, f"{name}: step 3 loss {resumed[3]} != {one[3]}"
