"""Where megalite writes, round 2: never through a link, pruning only its own names, nothing written by a
refused run, metrics resumed beside-and-rename, tools that only read writing nothing, outputs that cannot
land inside a checkpoint or as hidden files, and a full disk that leaves no temporary file.

Each case asserts the exit code, one line on stderr, no traceback, and that pre-existing files (the link
targets above all) are byte-identical afterwards.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from megalite import atomic
from megalite.checkpoint import claim as claims, files
from megalite.data import indexed
from megalite.observability.metrics import start_metrics_file
from megalite.parallel.state import ParallelState
from megalite.training.trainer import main
from tests.test_bad_inputs import CKPT, CONFIG, DATA, STORAGE, assert_one_line, snapshot
from tests.test_bad_inputs_checkpoint import _copy, _edit_index, _train, ck  # noqa: F401  (ck: the fixture)
from tools.export_hf import main as export_main
from tools.generate import main as generate_main
from tools.import_hf import main as import_main
from tools.preprocess_data import main as preprocess_main
from tools.reshard_checkpoint import main as reshard_main

VICTIM = b"a file of the user's, outside every directory megalite was given\n"


def demo_tokenizer(ck: dict[str, Any]) -> str:
    """The demo tokenizer the fixture's run trained with (already in the session's cache)."""
    from megalite.data.demo import cached_demo_data

    data = json.loads((ck["step"] / "index.json").read_text())["extra"]["config"]["data"]
    found = cached_demo_data(data["cache_dir"], data["demo_max_bytes"], data["demo_vocab_size"])
    assert found is not None
    return found[1]


def _victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victim = outside / "victim.txt"
    victim.write_bytes(VICTIM)
    return victim


# ----------------------------------------------------------------------------- links are never written through


@pytest.mark.parametrize("planted", [".megalite.lock", "latest", "step_00000001.tmp", "step_00000001",
                                     "hard:.megalite.lock"])
def test_links_in_the_checkpoint_dir_are_refused(ck: dict[str, Any], tmp_path: Path, capsys, planted: str) -> None:
    victim = _victim(tmp_path)
    target_dir = tmp_path / "outside" / "dir"
    target_dir.mkdir()
    (target_dir / "theirs.txt").write_bytes(VICTIM)
    run = tmp_path / "ck"
    run.mkdir()
    if planted.startswith("hard:"):
        os.link(victim, run / planted[5:])
    else:
        os.symlink(target_dir if "step_" in planted else victim, run / planted)
    before = snapshot(tmp_path / "outside")
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(run))
    needle = "hard links" if planted.startswith("hard:") else ("is a link" if planted != "latest" else str(run))
    assert_one_line(err, got, CKPT, needle)
    assert snapshot(tmp_path / "outside") == before and victim.read_bytes() == VICTIM
    assert not (tmp_path / "log" / "config.toml").exists(), "a refused run wrote its config"


@pytest.mark.parametrize("name", ["config.toml", "metrics.jsonl"])
def test_links_in_the_logging_dir_are_refused(ck: dict[str, Any], tmp_path: Path, capsys, name: str) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "log").mkdir()
    os.symlink(victim, tmp_path / "log" / name)
    got, err = _train(ck, tmp_path, capsys)
    assert_one_line(err, got, CONFIG, "is a link")
    assert victim.read_bytes() == VICTIM


def test_save_refuses_a_link_planted_after_the_start(tmp_path: Path) -> None:
    """The writers check too (not only the start): `latest`'s temporary name and a planted step_N.tmp."""
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / f".latest.tmp-{os.getpid()}")
    files.write_atomic(tmp_path / "latest", b"step_00000001\n")  # the stale link is removed, not followed
    assert victim.read_bytes() == VICTIM and (tmp_path / "latest").read_bytes() == b"step_00000001\n"
    os.symlink(victim.parent, tmp_path / "step_00000002.tmp")
    with pytest.raises(files.CheckpointError, match="is a link"):
        files.make_fresh_dir(tmp_path / "step_00000002.tmp")
    with pytest.raises(files.CheckpointError, match="is a link"):
        files.write_atomic(tmp_path / "step_00000002.tmp", b"x")
    assert victim.read_bytes() == VICTIM and (tmp_path / "step_00000002.tmp").is_symlink()


def test_outputs_of_the_tools_are_never_link_targets(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    victim = _victim(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    os.symlink(victim, hf / "config.json")
    got = export_main(["--input", str(ck["good"]), "--output", str(hf), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "is a link")
    assert not (hf / "model.safetensors").exists()
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(victim, data / "mine.bin")
    text = tmp_path / "text.txt"
    text.write_text("some text to tokenize\n" * 20)
    got = preprocess_main(["--input", str(text), "--tokenizer", demo_tokenizer(ck), "--output-prefix", str(data / "mine"),
                           "--quiet"])
    assert_one_line(capsys.readouterr().err, got, DATA, "is a link")
    assert victim.read_bytes() == VICTIM and sorted(p.name for p in data.iterdir()) == ["mine.bin"]


# ----------------------------------------------------------------------------- pruning: only megalite's own names


def test_pruning_deletes_only_names_megalite_wrote(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "index.json").parent.mkdir()
    (outside / "index.json").write_text("{}")
    base = tmp_path / "ck"
    names = ["step_00000001", "step_00000002", "step_00000003", "step_00000002.keep", "step_00000001-good-run",
             "step_1", "step_000000001"]
    for name in names:
        (base / name).mkdir(parents=True)
        (base / name / "index.json").write_text("{}")
    os.symlink(outside, base / "step_00000000")
    before = snapshot(outside)
    files.prune(base, keep=1, current="step_00000003")
    assert sorted(p.name for p in base.iterdir()) == sorted(set(names) - {"step_00000001", "step_00000002"}
                                                            | {"step_00000000"})
    assert snapshot(outside) == before
    assert claims.newest_step(base) == 3


# ----------------------------------------------------------------------------- a refused run writes nothing


def test_refused_runs_leave_the_previous_runs_files(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    """config.toml and metrics.jsonl are written only once every check that can refuse the run has passed."""
    good = _copy(ck["good"], tmp_path / "good")
    logs = _copy(ck["root"] / "log", tmp_path / "log")
    corrupt = _copy(ck["good"], tmp_path / "corrupt")
    rank0 = corrupt / "step_00000001" / "rank_00000.safetensors"
    rank0.write_bytes(rank0.read_bytes()[:-64] + b"x" * 64)
    before = snapshot(tmp_path)
    cases = [(("--checkpoint.dir", str(good), "--checkpoint.load", "none"), "already holds step 1"),
             (("--checkpoint.dir", str(corrupt), "--train.steps", "2"), "corrupt")]
    for extra, needle in cases:
        got, err = _train(ck, tmp_path, capsys, *extra)
        assert_one_line(err, got, CKPT, needle)
    claim = claims.claim_directory(str(good), 1, None, ParallelState())  # a live run holds it
    try:
        got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(good), "--train.steps", "2",
                          "--train.lr", "0.5")
    finally:
        claim.release()
    assert_one_line(err, got, CKPT, "in use by another run")
    claim = claims.claim_log_directory(str(logs), "", ParallelState())  # a live run logs there, no checkpoints
    try:
        got, err = _train(ck, tmp_path, capsys, "--train.lr", "0.5")
    finally:
        claim.release()
    assert_one_line(err, got, CONFIG, f"logging.dir {logs} is in use by another run")
    assert snapshot(tmp_path) == before


def test_saved_config_resolves_every_auto(ck: dict[str, Any]) -> None:
    saved = (ck["root"] / "log" / "config.toml").read_text()
    assert '"auto"' not in saved and 'backend = "gloo"' in saved


# ----------------------------------------------------------------------------- metrics.jsonl on resume


def test_metrics_resume_rewrites_beside_and_renames(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 6)] + ['{"step": 6, "lo']
    path.write_text("\n".join(lines))
    original = path.read_bytes()

    def full_disk(p: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(p))

    monkeypatch.setattr(atomic, "fsync_file", full_disk)  # where atomic_output finds it
    with pytest.raises(OSError, match="No space"):
        start_metrics_file(path, resumed_step=3)
    assert path.read_bytes() == original and os.listdir(tmp_path) == ["metrics.jsonl"]
    monkeypatch.undo()
    start_metrics_file(path, resumed_step=3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


# ----------------------------------------------------------------------------- tools that only read


def test_generate_builds_nothing_at_a_saved_cache_dir(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    ckpt = _copy(ck["good"], tmp_path / "ck")
    elsewhere = tmp_path / "someone-elses-cache"
    _edit_index(ckpt / "step_00000001", lambda ix: ix["extra"]["config"]["data"].update(cache_dir=str(elsewhere)))
    before = snapshot(tmp_path)
    got = generate_main(["--checkpoint", str(ckpt), "--prompt", "def", "--max-tokens", "2", "--device", "cpu"])
    assert_one_line(capsys.readouterr().err, got, DATA, "--tokenizer")
    assert not elsewhere.exists() and snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- outputs in the wrong place


def test_outputs_inside_a_checkpoint_or_hidden_are_refused(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    good = _copy(ck["good"], tmp_path / "good")
    before = snapshot(tmp_path)
    for out in (good / "step_00000001" / "resharded", good / "step_00000001" / "a" / "b"):
        got = reshard_main(["--input", str(good / "step_00000001"), "--output", str(out), "--quiet"])
        assert_one_line(capsys.readouterr().err, got, CKPT, "inside the saved checkpoint")
    got = import_main(["--input", str(ck["hf"]), "--output", str(good / "step_00000001" / "hf"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "inside the saved checkpoint")
    got = export_main(["--input", str(good), "--output", str(good / "step_00000001" / "hf"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "inside the saved checkpoint")
    text = tmp_path / "t.txt"
    text.write_text("x")
    for prefix in (str(tmp_path / "data") + "/", str(tmp_path / "data") + "/.bin", str(tmp_path / "data") + "/.."):
        got = preprocess_main(["--input", str(text), "--tokenizer", "unused", "--output-prefix", prefix, "--quiet"])
        assert_one_line(capsys.readouterr().err, got, CONFIG, "names a directory")
    text.unlink()
    assert snapshot(tmp_path) == before and not (tmp_path / "data").exists()


def test_full_disk_while_preprocessing_leaves_no_temporary_file(ck: dict[str, Any], tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    """The disk fills during a write and again when the partial file is closed (buffered bytes): the cleanup
    removes the temporary files all the same."""
    real_open = indexed.open_no_link

    class FullDisk:
        def __init__(self, f: Any) -> None:
            self._f = f

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self._f.close()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

    monkeypatch.setattr(indexed, "open_no_link", lambda *a, **k: FullDisk(real_open(*a, **k)))
    out = tmp_path / "out"
    out.mkdir()
    text = tmp_path / "t.txt"
    text.write_text("def f():\n    return 1\n" * 50)
    got = preprocess_main(["--input", str(text), "--tokenizer", demo_tokenizer(ck), "--output-prefix", str(out / "p"),
                           "--quiet"])
    assert_one_line(capsys.readouterr().err, got, STORAGE, "No space left")
    assert os.listdir(out) == []


# ----------------------------------------------------------------------------- reading through links is fine


def test_import_reads_a_hub_cache_snapshot_of_links(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    """A Hugging Face hub cache: snapshots/<rev>/* are relative links into ../../blobs (what transformers
    loads); the weights are sharded, with an index naming the shard."""
    hub = tmp_path / "models--me--tiny"
    blobs, snap = hub / "blobs", hub / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    shard = "model-00001-of-00001.safetensors"
    header = (ck["hf"] / "model.safetensors").read_bytes()
    keys = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
    contents = {"config.json": (ck["hf"] / "config.json").read_bytes(), shard: header,
                "model.safetensors.index.json": json.dumps(
                    {"weight_map": {k: shard for k in keys if k != "__metadata__"}}).encode()}
    for i, (name, data) in enumerate(contents.items()):
        (blobs / f"blob{i}").write_bytes(data)
        os.symlink(f"../../blobs/blob{i}", snap / name)
    before = snapshot(hub)
    got = import_main(["--input", str(snap), "--output", str(tmp_path / "imported"), "--quiet"])
    err = capsys.readouterr().err
    assert got == 0, err
    assert (tmp_path / "imported" / "index.json").is_file() and snapshot(hub) == before
    shutil.rmtree(tmp_path / "imported")
