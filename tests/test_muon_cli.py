"""`python pretrain.py --optimizer.name muon` end to end (in process, a tiny demo run): it trains and
checkpoints, resumes with Muon (its momentum restored from "exp_avg"), and refuses, with one line and the
checkpoint exit code, to resume the checkpoint with AdamW (in the run, in --check-config, and once under a
launcher: rank 1 leaves the line to rank 0); bad Muon fields are one config line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalite.training import trainer
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import assert_one_line


def _losses(log: Path) -> list[float]:
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_pretrain_with_muon_trains_resumes_and_refuses_a_switch(demo_cache_dir: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--checkpoint.dir", str(tmp_path / "ck")]
    assert main([*args, "--optimizer.name", "muon", "--train.steps", "2", "--logging.dir", str(tmp_path / "a")]) == 0
    losses = _losses(tmp_path / "a")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    capsys.readouterr()
    got = main([*args, "--optimizer.name", "adamw", "--train.steps", "3", "--logging.dir", str(tmp_path / "b")])
    assert_one_line(capsys.readouterr().err, got, 4, "optimizer.name=muon")
    # The same refusal in the launcher's preflight (launch/torchrun.sh runs --check-config first), and a
    # contradicted model shape there too: a resume mismatch is found before any worker starts.
    for flags, words in [(["--optimizer.name", "adamw"], "optimizer.name=muon"),
                         (["--optimizer.name", "muon", "--model.num_layers", "3"], "is a different model")]:
        got = main(["--check-config", "--world-size", "2", *args, *flags, "--train.steps", "3"])
        assert_one_line(capsys.readouterr().err, got, 4, words)
    # Under torchrun, rank 1 leaves that line to rank 0 (it raised before any process group: every rank
    # saw the same), instead of printing it once per rank.
    waited: list[bool] = []
    monkeypatch.setattr(trainer, "_leave_it_to_rank_0", lambda: waited.append(True))
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    got = main([*args, "--optimizer.name", "adamw", "--train.steps", "3", "--logging.dir", str(tmp_path / "b")])
    assert got == 4 and waited == [True]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k)
    capsys.readouterr()
    assert main([*args, "--optimizer.name", "muon", "--train.steps", "3", "--logging.dir", str(tmp_path / "c")]) == 0
    assert len(_losses(tmp_path / "c")) == 1  # resumed at step 2: one more step
    capsys.readouterr()
    got = main([*args, "--optimizer.name", "muon", "--muon.momentum", "1.5", "--logging.dir",
                str(tmp_path / "d")])
    assert_one_line(capsys.readouterr().err, got, 2, "muon.momentum must be in [0, 1)")
