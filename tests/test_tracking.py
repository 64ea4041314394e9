"""wandb tracking (offline, resumed), metric plots, and the launch scripts.

The wandb checks read back what was written: the run's `.wandb` file is a LevelDB-style record log
of protobuf `Record`s, decoded here to compare the logged config and history with what was passed.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from megalite.errors import DataError
from megalite.observability.tracking import RUN_ID_FILE, Tracker, flatten, has_wandb_credentials, wandb_mode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import plot_metrics  # noqa: E402  (tools/plot_metrics.py)


# ------------------------------------------------------------------ pure helpers

def test_flatten() -> None:
    nested = {"loss": 2.5, "mfu": None, "comm_bytes": {"tp": 10.0, "dp": 4}, "mem": {"peak": {"gpu": 1}}}
    assert flatten(nested) == {"loss": 2.5, "comm_bytes/tp": 10.0, "comm_bytes/dp": 4, "mem/peak/gpu": 1}


def test_mode_from_credentials(tmp_path: Path) -> None:
    no_netrc = tmp_path / "none"
    assert wandb_mode({"WANDB_MODE": "disabled"}, no_netrc) is None  # the user's choice wins
    assert wandb_mode({}, no_netrc) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}, no_netrc) == "online"
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert wandb_mode({}, rc) == "online"
    assert not has_wandb_credentials({"WANDB_BASE_URL": "https://wandb.example.com"}, rc)
    rc.write_text("machine wandb.example.com login user password secret\n")
    assert has_wandb_credentials({"WANDB_BASE_URL": "https://wandb.example.com:443/"}, rc)


def test_disabled_is_a_noop(tmp_path: Path) -> None:
    for project, enabled in (("", True), ("p", False)):
        t = Tracker(project, "", "r", {"a": 1}, str(tmp_path / "logs"), enabled)
        t.log({"loss": 1.0}, step=1)
        t.finish()
        assert not t.enabled
    assert not (tmp_path / "logs").exists()


def test_wandb_failures_never_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    t = Tracker("p", "", "r", {}, str(tmp_path), True)
    t.log({"loss": 1.0}, step=1)
    assert not t.enabled and capsys.readouterr().err.count("warning") == 1

    def broken_init(**_: object) -> None:
        raise RuntimeError("no network")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=broken_init))
    t = Tracker("p", "", "r", {}, str(tmp_path), True)
    t.log({"loss": 1.0}, step=1)
    t.finish()
    err = capsys.readouterr().err
    assert not t.enabled and err.count("warning") == 1 and "no network" in err


def test_progress_units_adapt() -> None:
    """A slow run's rate reads in tok/s, not "0.0k tok/s"; step times in ms below a second."""
    from megalite.observability.metrics import format_bytes, format_rate, format_step_time

    assert [format_rate(x) for x in (7.42, 850.0, 21_300.0, 4.56e6)] == \
        ["7.42 tok/s", "850 tok/s", "21.3k tok/s", "4.56M tok/s"]
    assert [format_step_time(x) for x in (0.048, 552.34)] == ["48 ms", "552.34 s"]
    assert format_bytes(361.7 * 2**20) == "361.70 MiB" and format_bytes(5.09 * 2**30) == "5.09 GiB"


# ------------------------------------------------------------------ offline run + resume

def _records(run_file: Path) -> list[object]:
    """Decode a .wandb file: 7-byte header, then 32 KiB blocks of chunks (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block = run_file.read_bytes(), 7, 32768
    payloads: list[bytes] = []
    partial = b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            payloads.append(data)
        elif kind == 2:  # first
            partial = data
        elif kind == 3:  # middle
            partial += data
        elif kind == 4:  # last
            payloads.append(partial + data)
    records = []
    for data in payloads:
        rec = pb.Record()
        rec.ParseFromString(data)
        records.append(rec)
    return records


def _history_and_config(run_file: Path) -> tuple[list[dict], dict]:
    history, config = [], {}
    for rec in _records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return history, config


def test_offline_run_and_resume(tmp_path: Path) -> None:
    """Run in a fresh interpreter: wandb keeps process-wide state (a service process, settings) that
    other tests in the same pytest process can leave behind.

    Two things made it fail on a loaded machine: wandb gives up on its service after 30 s and on
    `wandb.init` after 90 s by default (Tracker then carries on without wandb, as it must in a training
    run), and the .wandb files were read before wandb's service had finished writing them. Here both
    waits are an hour, and the files are read after `wandb.teardown()`."""
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
               WANDB_CACHE_DIR=str(tmp_path / "cache"), WANDB_DATA_DIR=str(tmp_path / "data"),
               WANDB_INIT_TIMEOUT="3600", WANDB__SERVICE_WAIT="3600")
    code = "import sys; from pathlib import Path; from tests.test_tracking import offline_run_and_resume; " \
           "offline_run_and_resume(Path(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=str(Path(__file__).resolve().parents[1]), timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def offline_run_and_resume(tmp_path: Path) -> None:
    log_dir = tmp_path / "run"
    config = {"model": {"num_layers": 2}, "parallel": {"tp": 1}}
    with Tracker("megalite-test", "", "tiny", config, str(log_dir), True) as t:
        assert t.enabled
        for step in (1, 2):
            t.log({"loss": 3.0 / step, "mfu": None, "comm_bytes": {"dp": 8.0 * step}}, step=step)
        first_id = t.run_id
    assert (log_dir / RUN_ID_FILE).read_text().strip() == first_id
    with Tracker("megalite-test", "", "tiny", config, str(log_dir), True) as t:
        assert t.run_id == first_id  # the resumed process continues the same wandb run
        t.log({"loss": 0.5, "comm_bytes": {"dp": 24.0}}, step=3)
    # run.finish() returns before wandb's service process has written everything to the .wandb files
    # (on a busy machine the last records were still missing when read); teardown waits for that
    # process to exit, so the files are complete, however long it takes.
    import wandb

    wandb.teardown()
    # One directory per process, named by start time (a "-1" suffix within the same second); the
    # histories are matched by their steps, not by the names' order.
    runs = list((log_dir / "wandb").glob(f"offline-run-*-{first_id}*/run-{first_id}.wandb"))
    assert len(runs) == 2, list((log_dir / "wandb").iterdir())
    (hist1, cfg1), (hist2, _) = sorted((_history_and_config(r) for r in runs), key=lambda hc: hc[0][0]["_step"])
    assert cfg1["model"] == {"num_layers": 2} and cfg1["parallel"] == {"tp": 1}
    got = [(h["_step"], h["loss"], h["comm_bytes/dp"]) for h in hist1 + hist2]
    assert got == [(1, 3.0, 8.0), (2, 1.5, 16.0), (3, 0.5, 24.0)]
    assert all("mfu" not in h for h in hist1)


# ------------------------------------------------------------------ plots

def _write_metrics(path: Path, steps: int, tp: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in range(1, steps + 1):
            comm = {"dp": 1e6, **({"tp": 3e6} if tp else {})}
            f.write(json.dumps({"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0,
                                "tokens_per_s": 1000.0 + s, "tflops_per_device": 0.1, "mfu": None,
                                "mem_peak_bytes": 1 << 20, "comm_bytes": comm, "skipped": False}) + "\n")


def test_plot_metrics(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl"
    _write_metrics(a, 5, tp=False)
    _write_metrics(b, 4, tp=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        plot_metrics.load_metrics(bad)
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "cmp.png"
    assert plot_metrics.main([str(a), str(b.parent), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_draws_one_line_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run folder holds the current run and the runs a fresh start moved aside; a file written before
    rotation existed (two runs appended) is split where the step goes back."""
    run = tmp_path / "latest"
    _write_metrics(run / "metrics.1.jsonl", 5, tp=False)
    _write_metrics(run / "metrics.jsonl", 3, tp=False)
    runs = plot_metrics.load_runs(run, "latest")
    assert {k: [r["step"] for r in v] for k, v in runs.items()} == {"latest #1": [1, 2, 3, 4, 5],
                                                                     "latest #2": [1, 2, 3]}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text((run / "metrics.1.jsonl").read_text() + (run / "metrics.jsonl").read_text())
    assert [len(r) for r in plot_metrics.split_runs(plot_metrics.load_metrics(mixed))] == [5, 3]
    pytest.importorskip("matplotlib")
    assert plot_metrics.main([str(run)]) == 0  # default output: next to the run, never in the repo
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(run / "metrics.png") in capsys.readouterr().out


# ------------------------------------------------------------------ launchers

@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/slurm.sbatch"])
def test_launch_scripts_parse(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


_FAKE_PRETRAIN = """
import os, signal, sys, time
if "--check-config" in sys.argv:  # the launcher's one-process check before the workers
    sys.exit(0)
out = sys.argv[-1]
def stop(sig, frame):
    with open(os.path.join(out, "stopped" + os.environ["RANK"]), "w") as f:
        f.write(signal.Signals(sig).name + " " + os.environ["WORLD_SIZE"] + " " + " ".join(sys.argv[1:-1]))
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "started" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""


def test_slurm_script_forwards_usr1_to_workers(tmp_path: Path) -> None:
    """The batch shell's SIGUSR1 (Slurm's --signal=B:USR1) must reach every pretrain.py worker
    through srun and torchrun. srun and scontrol are stand-ins (one node) on PATH."""
    bin_dir, repo, out = tmp_path / "bin", tmp_path / "repo", tmp_path / "out"
    for d in (bin_dir, repo, out):
        d.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (repo / "pretrain.py").write_text(_FAKE_PRETRAIN)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "MEGALITE_DIR": str(repo), "NPROC_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_JOB_ID": "4242", "PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(REPO / "launch/slurm.sbatch"), "--train.steps", "3", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600  # a hang guard only
        while not all((out / f"started{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in (0, 1):
        assert (out / f"stopped{r}").read_text() == "SIGUSR1 2 --train.steps 3"
