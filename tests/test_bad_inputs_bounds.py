"""Absurd numbers: every numeric config field whose huge value would hang a step, overflow or allocate without
limit has an upper bound (megalite/config/values.py MAXIMA, the feature sections' own), refused before anything
runs with one line and exit 2; and a document mask over data without end-of-document tokens is refused (exit 3)
instead of silently masking nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megalite.config.values import MAXIMA
from megalite.data.demo import prepare_demo_data
from megalite.data.indexed import IndexedDataset, IndexedDatasetWriter
from megalite.errors import DataError
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CONFIG, DATA, assert_one_line

# (flags, what the one line names): the examples first, then one per bound
ABSURD = [(["--moe.experts", "4", "--moe.capacity_factor", "1e308"], "moe.capacity_factor"),
          (["--optimizer.name", "muon", "--muon.ns_steps", "1000000000"], "muon.ns_steps"),
          (["--optimizer.name", "muon", "--muon.rms", "1e308"], "muon.rms"),
          (["--moe.experts", "4", "--moe.groups", "2"], "moe.groups 2 needs moe.router=deepseek"),
          (["--moe.experts", "4", "--moe.router", "qwen3", "--moe.groups", "2"], "moe.groups"),
          (["--moe.experts", "4", "--moe.aux_loss", "1e308"], "moe.aux_loss"),
          (["--moe.experts", "100000"], "moe.experts"),
          (["--optimizer.weight_decay", "1000"], "train.lr x optimizer.weight_decay"),
          (["--optimizer.adam_eps", "1e300"], "optimizer.adam_eps"),
          *[([f"--{key}", f"{most * 2:g}" if isinstance(most, float) else str(most * 2)], key)
            for key, (most, _) in MAXIMA.items()]]


@pytest.mark.parametrize("flags,needle", ABSURD, ids=[" ".join(f) for f, _ in ABSURD])
def test_absurd_values_are_refused_before_anything_runs(tmp_path: Path, capsys, flags: list[str], needle: str) -> None:
    got = main([*SMALL_RUN, "--logging.dir", str(tmp_path / "log"), *flags])
    assert_one_line(capsys.readouterr().err, got, CONFIG, needle)
    assert not (tmp_path / "log").exists()  # refused before config.toml or any output was written


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    """The control: a value at each bound passes validation (the bound is inclusive, and the cases above fail
    because of their value, not their flag)."""
    from megalite.config import parse_args
    from megalite.config.values import maximum_problems

    for key, (most, _) in MAXIMA.items():
        cfg = parse_args([f"--{key}", f"{most:g}" if isinstance(most, float) else str(most)])
        assert not [p for p in maximum_problems(cfg) if p.startswith(key + " ") and " is above " in p], key


def _dataset(path: Path, docs: list[list[int]]) -> IndexedDataset:
    with IndexedDatasetWriter(str(path), vocab_size=512) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    return IndexedDataset(str(path), vocab_size=512)


def test_document_ends_are_checked(tmp_path: Path) -> None:
    _dataset(tmp_path / "eod", [[5, 6, 2], [7, 2], [8, 9, 10, 2]]).check_document_ends(2)  # every doc ends in EOD
    with pytest.raises(DataError, match="none of 3 documents"):
        _dataset(tmp_path / "none", [[5, 6, 7], [7, 8], [8, 9, 10]]).check_document_ends(2)


def test_a_document_mask_over_data_without_eod_is_refused(demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    """The run refuses in build_data, before the model exists (exit 3, one line), rather than train unmasked."""
    _, tokenizer = prepare_demo_data(demo_cache_dir, 300_000, 512)
    capsys.readouterr()  # its "building the demo corpus" note, when this test builds it first
    _dataset(tmp_path / "noeod", [[(i * 7 + j) % 500 + 5 for j in range(200)] for i in range(64)])
    got = main([*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--logging.dir", str(tmp_path / "log"),
                "--data.path", str(tmp_path / "noeod"), "--data.tokenizer", tokenizer, "--data.document_mask"])
    assert_one_line(capsys.readouterr().err, got, DATA, "data.document_mask")
