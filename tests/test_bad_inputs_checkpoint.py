"""Checkpoints under hostile and careless use: one run per directory, no silent rewind, writability before
step 1, no partial files after a failed save, names that stay inside their directory, every file verified,
hand-edited metadata refused, and tools (export/import/reshard) that never damage what already exists.

Each case asserts the exit code, one line on stderr, no traceback, and, where something was saved before,
that it is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from megalite.checkpoint import claim as claims, storage
from megalite.parallel.state import ParallelState
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CKPT, CONFIG, assert_one_line, run_scripts, snapshot
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main
from tools.reshard_checkpoint import main as reshard_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ck(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A good 1-step checkpoint, its HF export, and the common arguments of a small run."""
    root = tmp_path_factory.mktemp("ckbad")
    args = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--train.steps", "1"]
    good = root / "good"
    assert main([*args, "--logging.dir", str(root / "log"), "--checkpoint.dir", str(good)]) == 0
    assert export_main(["--input", str(good), "--output", str(root / "hf"), "--quiet"]) == 0
    return {"root": root, "args": args, "good": good, "step": good / "step_00000001", "hf": root / "hf"}


def _train(ck: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    got = main([*ck["args"], "--logging.dir", str(tmp_path / "log"), *extra])
    return got, capsys.readouterr().err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(step_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    index = json.loads((step_dir / "index.json").read_text())
    change(index)
    (step_dir / "index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------------------- one run per directory


def test_directory_in_use_by_another_run(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    shared = _copy(ck["good"], tmp_path / "shared")
    before = snapshot(shared)
    claim = claims.claim_directory(str(shared), 1, None, ParallelState())
    try:
        got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(shared), "--train.steps", "2")
    finally:
        claim.release()
    assert_one_line(err, got, CKPT, "in use by another run")
    assert f"pid {os.getpid()}" in err  # names the owner
    assert snapshot(shared) == before


def test_lock_of_a_killed_run_is_released(tmp_path: Path) -> None:
    """flock belongs to the process: SIGKILL cannot leave the directory stuck."""
    code = ("import sys, time; from megalite.checkpoint import claim; from megalite.parallel.state import "
            f"ParallelState; c = claim.claim_directory({str(tmp_path)!r}, 0, None, ParallelState()); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(claims.CheckpointError, match="in use"):
            claims.claim_directory(str(tmp_path), 0, None, ParallelState())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    claims.claim_directory(str(tmp_path), 0, None, ParallelState()).release()


def test_fresh_run_never_rewinds_an_old_directory(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    old = _copy(ck["good"], tmp_path / "old")
    before = snapshot(old)
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(old), "--checkpoint.load", "none")
    assert_one_line(err, got, CKPT, "already holds step 1")
    assert snapshot(old) == before


def test_going_back_on_purpose(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    """Loading an earlier step of the same directory is the explicit way back: allowed, and pruning never
    deletes the checkpoint `latest` then names (nor the later steps of the abandoned run)."""
    run = tmp_path / "run"
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(run), "--train.steps", "3",
                      "--checkpoint.interval", "1")
    assert got == 0, err
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(run), "--train.steps", "2", "--checkpoint.load",
                      str(run / "step_00000001"), "--checkpoint.keep", "1")
    assert got == 0, err
    assert (run / "latest").read_text().strip() == "step_00000002" and (run / "step_00000002" / "index.json").is_file()
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_checkpoint_dir_inside_a_step_directory(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    before = snapshot(ck["good"])
    for inner in (ck["step"], ck["step"] / "more"):
        got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(inner))
        assert_one_line(err, got, CONFIG, "inside the saved checkpoint")
    assert snapshot(ck["good"]) == before


def test_unwritable_directory_found_before_step_1(ck: dict[str, Any], tmp_path: Path, capsys, monkeypatch) -> None:
    def refuse(directory: Path) -> None:  # root ignores chmod, so stand in for a read-only mount
        raise OSError(30, "Read-only file system", str(directory / "probe"))

    monkeypatch.setattr(claims, "_probe_writable", refuse)
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(tmp_path / "ro"))
    assert_one_line(err, got, CKPT, "Read-only file system")
    assert not (tmp_path / "log" / "metrics.jsonl").exists(), "trained although the checkpoint cannot be saved"


def test_failed_save_leaves_no_partial_files(ck: dict[str, Any], tmp_path: Path, capsys, monkeypatch) -> None:
    def disk_full(self: Any, key: str, tensor: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.StreamingWriter, "write", disk_full)
    target = tmp_path / "full"
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(target))
    assert_one_line(err, got, CKPT, "No space left on device")
    assert not list(target.glob("step_*")), "a failed save left files behind"


# ----------------------------------------------------------------------------- trust boundaries


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "slab file outside": (lambda ix: [s.update(file="../../good/step_00000001/rank_00000.safetensors")
                                      for t in ix["tensors"].values() for s in t["slabs"]], "no sha256"),
    "file missing from checksums": (lambda ix: ix["files"].clear(), "no sha256"),
    "checksum list without one file": (lambda ix: ix["files"].update({"rank_00000.safetensors": "0" * 64}),
                                       "sha256 mismatch"),
    "step missing": (lambda ix: ix.pop("step"), "step=None"),
    "step a string": (lambda ix: ix.update(step="7"), "step='7'"),
    "unknown dtype": (lambda ix: next(iter(ix["tensors"].values())).update(dtype="float128"), "float128"),
    "model dim zero": (lambda ix: ix["model"].update(hidden_size=0), "hidden_size=0"),
    "model dim missing": (lambda ix: ix["model"].pop("num_heads"), "num_heads=None"),
    "model dims contradict": (lambda ix: ix["model"].update(num_kv_heads=3), "not divisible by num_kv_heads=3"),
    "sampler position garbled": (lambda ix: ix["extra"]["sampler"].update(consumed_samples="many"), "extra.sampler"),
    "loss scale NaN": (lambda ix: ix["extra"].update(scaler={"scale": float("nan"), "good_steps": 0}), "extra.scaler"),
    "tensors not an object": (lambda ix: ix.update(tensors=[]), "'tensors'"),
    "slab beyond the tensor": (lambda ix: next(iter(ix["tensors"].values()))["slabs"][0].update(offset=[10**6, 0]),
                               "slab"),
}


def test_edited_index_is_refused_by_every_reader(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    """Each edit, loaded by the exporter and the resharder (in-process): one line, exit 4, nothing written."""
    for i, (case, (change, needle)) in enumerate(EDITS.items()):
        ckpt = _copy(ck["step"], tmp_path / f"c{i}")
        _edit_index(ckpt, change)
        for tool, out in ((export_main, tmp_path / f"hf{i}"), (reshard_main, tmp_path / f"rs{i}")):
            capsys.readouterr()
            got = tool(["--input", str(ckpt), "--output", str(out), "--quiet"])
            err = capsys.readouterr().err
            assert_one_line(err, got, CKPT, needle)
            assert not out.exists() or not any(out.iterdir()), f"{case}: {tool.__module__} wrote output"


def test_edited_index_refused_by_training(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    ckpt = _copy(ck["step"], tmp_path / "edited")
    _edit_index(ckpt, lambda ix: ix["files"].pop("rank_00000.safetensors"))
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.load", str(ckpt))
    assert_one_line(err, got, CKPT, "sha256")


def test_latest_pointer_leaving_the_directory(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    root = _copy(ck["good"], tmp_path / "root")
    for pointer in ("../good/step_00000001", "/etc", ".."):
        (root / "latest").write_text(pointer + "\n")
        got, err = _train(ck, tmp_path, capsys, "--checkpoint.load", str(root))
        assert_one_line(err, got, CKPT, "latest pointer")


def test_data_file_linked_out_of_the_checkpoint(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    ckpt = _copy(ck["step"], tmp_path / "linked")
    outside = tmp_path / "outside.safetensors"
    (ckpt / "rank_00000.safetensors").rename(outside)
    (ckpt / "rank_00000.safetensors").symlink_to(outside)
    got = export_main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "outside the checkpoint")


# ----------------------------------------------------------------------------- tools never damage outputs


def test_export_over_a_good_export_with_broken_input(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    hf = _copy(ck["hf"], tmp_path / "hf")
    before = snapshot(hf)
    broken = _copy(ck["step"], tmp_path / "broken")
    data = broken / "rank_00000.safetensors"
    data.write_bytes(data.read_bytes()[:-64] + b"x" * 64)  # found only while streaming the tensors
    capsys.readouterr()
    got = export_main(["--input", str(broken), "--output", str(hf), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "sha256 mismatch")
    assert snapshot(hf) == before, "the existing export was modified"
    assert sorted(p.name for p in hf.iterdir()) == sorted(before), "temporary files left behind"


def test_export_output_under_a_file(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    got = export_main(["--input", str(ck["step"]), "--output", str(tmp_path / "f" / "hf"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "is a file or lies under one")


def test_reshard_keeps_users_files_and_checks_arguments(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    mine = tmp_path / "out.tmp"  # a user's own directory that merely looks like a temporary name
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "a").write_text("a")
    before = snapshot(tmp_path)
    cases = [(["--tp", "0"], CONFIG, "--tp 0 must be >= 1"), (["--pp", "-2"], CONFIG, "--pp -2"),
             (["--pp-layers", "a,b"], CONFIG, "comma-separated"), (["--pp", "2", "--pp-layers", "1"], CONFIG, "2 entries"),
             (["--pp-layers", "0,2", "--pp", "2"], CONFIG, "at least 1 layer"), (["--tp", "3"], CONFIG, "--tp 3"),
             (["--pp", "3"], CONFIG, "give --pp-layers"), (["--tp", "x"], CONFIG, "invalid int value"),
             (["--output", str(existing)], CKPT, "already exists"),
             (["--output", str(tmp_path / "f" / "x")], CKPT, "cannot create output")]
    (tmp_path / "f").write_text("file")
    before["f"] = snapshot(tmp_path)["f"]
    for extra, code, needle in cases:
        argv = ["--input", str(ck["good"]), "--output", str(out), "--quiet", *extra]
        capsys.readouterr()
        got = reshard_main(argv)
        assert_one_line(capsys.readouterr().err, got, code, needle)
    assert reshard_main(["--input", str(ck["good"]), "--output", str(out), "--quiet", "--tp", "2"]) == 0
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == before
    assert (mine / "notes.txt").read_text() == "keep me"


def _hf_copy(ck: dict[str, Any], dst: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    hf = _copy(ck["hf"], dst)
    cfg = json.loads((hf / "config.json").read_text())
    change(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


HF_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "intermediate_size disagrees": (lambda c: c.update(intermediate_size=c["intermediate_size"] * 2),
                                    "disagree with config.json"),
    "hidden_size missing": (lambda c: c.pop("hidden_size"), "lacks or garbles"),
    "zero heads": (lambda c: c.update(num_attention_heads=0), "lacks or garbles"),
    "negative layers": (lambda c: c.update(num_hidden_layers=-1), "num_layers=-1"),
    "kv heads contradict": (lambda c: c.update(num_key_value_heads=3), "num_kv_heads=3"),
    "vocab as a string": (lambda c: c.update(vocab_size="512"), "vocab_size='512'"),
    "not a model": (lambda c: c.update(model_type="bert"), "'bert'"),
    "no model_type": (lambda c: c.clear() or c.update(x=1), "model_type None"),
}


def test_import_refuses_bad_hf_configs(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    for i, (case, (change, needle)) in enumerate(HF_EDITS.items()):
        hf = _hf_copy(ck, tmp_path / f"hf{i}", change)
        out = tmp_path / f"ck{i}"
        capsys.readouterr()
        got = import_main(["--input", str(hf), "--output", str(out), "--quiet"])
        assert_one_line(capsys.readouterr().err, got, CKPT, needle)
        assert not out.exists(), case
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], "temporary directories left behind"


def test_import_config_not_utf8_or_json(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    hf = _copy(ck["hf"], tmp_path / "hf")
    for content, needle in ((b"{\"model_type\": \"ll\xe9ma\"}", "cannot read"), (b"{oops", "cannot read")):
        (hf / "config.json").write_bytes(content)
        got = import_main(["--input", str(hf), "--output", str(tmp_path / "out"), "--quiet"])
        assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert not (tmp_path / "out").exists()


def test_import_weight_map_cannot_leave_the_directory(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    hf = _copy(ck["hf"], tmp_path / "hf")
    (hf / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    keys = json.loads((tmp_path / "elsewhere.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "elsewhere.safetensors").read_bytes()[:8], "little")])
    weight_map = {k: "../elsewhere.safetensors" for k in keys if k != "__metadata__"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = import_main(["--input", str(hf), "--output", str(tmp_path / "out"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "weight_map")
    assert not (tmp_path / "out").exists()


def test_import_into_an_existing_directory_changes_nothing(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    before = snapshot(ck["good"])
    got = import_main(["--input", str(ck["hf"]), "--output", str(ck["good"]), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, "already exists")
    assert snapshot(ck["good"]) == before


def test_tools_from_the_command_line(ck: dict[str, Any], tmp_path: Path) -> None:
    """The `python tools/x.py` path: argparse errors and refusals are one line too (each script's `__main__`, in
    one interpreter: tests/test_bad_inputs.py's `run_scripts`)."""
    runs = [(["tools/export_hf.py", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "o")], CKPT,
             "not a complete megalite checkpoint"),
            (["tools/reshard_checkpoint.py", "--input", str(ck["good"])], CONFIG, "--output")]
    results = run_scripts([argv for argv, _, _ in runs], tmp_path)
    for (_, code, needle), (got, err) in zip(runs, results, strict=True):
        assert_one_line(err, got, code, needle)


def _claim_on_every_rank(rank: int, directory: str, start_step: int) -> str:
    state = ParallelState(dp=2, rank=rank)
    try:
        claims.claim_directory(directory, start_step, None, state).release()
    except claims.CheckpointError as e:
        return f"refused: {e}"
    return "claimed"


def test_refusal_on_rank_0_stops_every_rank(dist_world, tmp_path: Path) -> None:
    """Rank 0 checks the directory; its verdict reaches every rank (none trains alone, none hangs)."""
    assert dist_world(2).run(_claim_on_every_rank, str(tmp_path), 0) == ["claimed", "claimed"]
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "step_00000005" / "index.json").write_text("{}")
    out = dist_world(2).run(_claim_on_every_rank, str(tmp_path), 0)
    assert out[0].startswith("refused") and "already holds step 5" in out[0], out
    assert out[1].startswith("refused") and "rank 0 refused" in out[1], out
