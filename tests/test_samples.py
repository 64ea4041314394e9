"""Samples during training (logging.sample_interval): logged to stdout, metrics.jsonl and wandb (a table),
and the run's losses are bit-for-bit those of the same run without samples."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megalite.data import load_tokenizer
from megalite.inference.samples import TrainingSamples
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.parallel_utils import reference_optimizer, tiny_model_cfg
from tests.tokenizer_utils import train_hf_bpe


def _rows(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_samples_logged_and_losses_unchanged(demo_cache_dir: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--train.steps", "4"]
    assert main(base + ["--logging.dir", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(base + ["--logging.dir", str(tmp_path / "s"), "--logging.sample_interval", "2",
                        "--logging.sample_prompt", "def ", "--logging.sample_tokens", "8"]) == 0
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "s")
    samples = [r for r in rows if "sample" in r]
    assert [r["step"] for r in samples] == [2, 4] and all(r["sample_prompt"] == "def " for r in samples)
    assert all(isinstance(r["sample"], str) for r in samples) and "sample at step 2: 'def ' -> " in out
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert losses == {r["step"]: r["loss"] for r in _rows(tmp_path / "plain")}


class _FakeLogger:
    def __init__(self, path: Path) -> None:
        self.enabled, self.path, self.notes = True, path, []

    def note(self, message: str) -> None:
        self.notes.append(message)


class _FakeTracker:
    def __init__(self) -> None:
        self.enabled, self.logged = True, []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))


def test_wandb_table_and_prompt_framing(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb")
    tok = load_tokenizer(str(train_hf_bpe(tmp_path / "t" / "tokenizer.json")))
    model = GPT(tiny_model_cfg("llama", vocab_size=tok.vocab_size, seq_len=32), ParallelState(), seed=1)
    logger, tracker = _FakeLogger(tmp_path / "metrics.jsonl"), _FakeTracker()
    cfg = SimpleNamespace(sample_interval=3, sample_prompt="", sample_tokens=5)
    samples = TrainingSamples(cfg, tok, [model], ParallelState(), torch.float32, logger, tracker)
    assert samples.prompt_ids() == [tok.eod_id]  # empty prompt: a new document starts after EOD
    opt = reference_optimizer(model, ParallelState(), lr=1e-3, weight_decay=0.0)
    assert [samples.maybe_sample(s, opt) is not None for s in range(1, 7)] == [False, False, True, False, False, True]
    assert model.training  # back in training mode
    step, logged = tracker.logged[-1]
    table = logged["samples"]
    assert step == 6 and isinstance(table, wandb.Table) and [r[0] for r in table.data] == [3, 6]
    # A pipeline-parallel layout: one note, no samples.
    other = TrainingSamples(cfg, tok, [model], ParallelState(pp=2), torch.float32, logger, tracker)
    assert other.maybe_sample(3, opt) is None and "no samples will be logged" in logger.notes[-1]
