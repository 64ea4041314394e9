"""`python pretrain.py --train.optimizer muon` end to end (in process, a tiny demo run): it trains and
checkpoints, resumes with Muon (its momentum restored from "exp_avg"), and refuses, with one line and the
checkpoint exit code, to resume the checkpoint with AdamW; bad Muon fields are one config line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import assert_one_line


def _losses(log: Path) -> list[float]:
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_pretrain_with_muon_trains_resumes_and_refuses_a_switch(demo_cache_dir: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--checkpoint.dir", str(tmp_path / "ck")]
    assert main([*args, "--train.optimizer", "muon", "--train.steps", "2", "--logging.dir", str(tmp_path / "a")]) == 0
    losses = _losses(tmp_path / "a")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    capsys.readouterr()
    got = main([*args, "--train.optimizer", "adamw", "--train.steps", "3", "--logging.dir", str(tmp_path / "b")])
    assert_one_line(capsys.readouterr().err, got, 4, "train.optimizer=muon")
    assert main([*args, "--train.optimizer", "muon", "--train.steps", "3", "--logging.dir", str(tmp_path / "c")]) == 0
    assert len(_losses(tmp_path / "c")) == 1  # resumed at step 2: one more step
    capsys.readouterr()
    got = main([*args, "--train.optimizer", "muon", "--train.muon_momentum", "1.5", "--logging.dir",
                str(tmp_path / "d")])
    assert_one_line(capsys.readouterr().err, got, 2, "train.muon_momentum must be in [0, 1)")
