"""Crashes, preemption, hangs and numerical faults, end to end (faults injected with MEGALITE_FAULT,
see megalite/runtime/faults.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.pool_pretrain import run_pretrain_in_pool

REPO = Path(__file__).resolve().parents[1]


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _args(cache: str, log_dir: Path, *extra: str) -> list[str]:
    return ["--data.cache_dir", cache, *SMALL_RUN, "--logging.dir", str(log_dir), *extra]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MEGALITE_FAULT")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _torchrun(args: list[str], *, restarts: int = 0, **env: str) -> subprocess.CompletedProcess:
    # --standalone: torchrun binds a port of its own choosing (no window for a concurrent run to take it).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), str(REPO / "pretrain.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), cwd=str(REPO), timeout=900)


def test_killed_rank_restarts_from_latest_checkpoint_and_matches(dist_world, demo_cache_dir: str,
                                                                 tmp_path: Path) -> None:
    """SIGKILL on rank 1 at step 5 under torchrun --max-restarts 1: the job resumes from step 4 and ends
    with the same losses as an uninterrupted run (fp32, same layout, one thread per rank in both: bitwise;
    the uninterrupted one runs in the warm ranks, tests/pool_pretrain.py): no sample skipped or repeated."""
    common = ["--train.steps", "8", "--train.global_batch_size", "8", "--checkpoint.interval", "2"]
    clean = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, tmp_path / "clean", *common, "--checkpoint.dir",
                                                   str(tmp_path / "c1")), nproc=2)
    assert clean.returncode == 0, clean.stderr[-2000:]
    crash = _torchrun(_args(demo_cache_dir, tmp_path / "crash", *common, "--checkpoint.dir", str(tmp_path / "c2")),
                      restarts=1, MEGALITE_FAULT="kill:rank=1:step=5")
    assert crash.returncode == 0, crash.stderr[-2000:]
    assert "resumed from" in crash.stdout
    want = {r["step"]: r["loss"] for r in _rows(tmp_path / "clean")}
    got = {r["step"]: r["loss"] for r in _rows(tmp_path / "crash")}  # steps 5.. logged by the restarted job
    assert sorted(got) == list(range(1, 9))
    assert all(got[s] == want[s] for s in want), (got, want)


def test_hang_is_reported_by_the_watchdog(demo_cache_dir: str, tmp_path: Path) -> None:
    # The watchdog arms once 3 steps are timed, so step 4 is the first step it watches: the hang is injected
    # there, and no healthy step is ever watched. Then no load can make a healthy step trip it, and the limit
    # (max(2 s, 5 x the median of steps 1-3)) only sets how long the test waits for the injected hang (forever).
    proc = _torchrun(_args(demo_cache_dir, tmp_path, "--train.steps", "5", "--train.global_batch_size", "8",
                           "--train.watchdog_factor", "5", "--train.watchdog_min_s", "2"),
                     MEGALITE_FAULT="hang:rank=1:step=4")
    assert proc.returncode != 0
    # The hung rank itself reports (its watchdog times the whole step, the injected hang at its start
    # included), whether or not its peer, blocked in a collective, reported first.
    assert "watchdog: rank 1 step 4" in proc.stderr, proc.stderr[-3000:]
    assert "last operation entered" in proc.stderr


def _sigterm_after_3_steps(args: list[str], log_dir: Path) -> tuple[str, str]:
    """Start pretrain.py with `args`, SIGTERM it once 3 steps are in `log_dir`'s metrics.jsonl; it must exit 0.
    Returns its stdout and stderr."""
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(REPO))
    metrics = log_dir / "metrics.jsonl"
    deadline = time.time() + 600  # a hang guard only: the loop ends as soon as 3 steps are logged
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return out, err


def test_sigterm_saves_and_exits_cleanly_then_resumes(demo_cache_dir: str, tmp_path: Path) -> None:
    """SIGTERM mid-run: the step ends, its checkpoint is saved and the process exits 0; the next launch resumes.
    The save is a background one (checkpoint.async_save), so the same run shows that the exit waits for the
    write in flight: the stopped step's checkpoint is complete and published. (The synchronous save on a
    signal is tests/test_stop_signals.py's, after Ctrl-C.)"""
    ckpt = tmp_path / "ckpt"
    args = _args(demo_cache_dir, tmp_path / "log", "--train.steps", "100000", "--checkpoint.dir", str(ckpt),
                 "--checkpoint.async_save", "true")
    out, err = _sigterm_after_3_steps(args, tmp_path / "log")
    assert "stop requested by signal" in out
    stopped = re.search(r"exiting cleanly after step (\d+)", out + err)
    assert stopped is not None, out[-2000:]
    step = int(stopped.group(1))
    name = f"step_{step:08d}"
    assert step >= 3 and (ckpt / "latest").read_text().strip() == name and (ckpt / name / "index.json").is_file()
    assert f"saved checkpoint {ckpt / name}" in out + err
    assert not list(ckpt.glob("*.tmp"))
    # The next launch resumes by itself (checkpoint.load defaults to the newest in checkpoint.dir).
    assert main(_args(demo_cache_dir, tmp_path / "log2", "--train.steps", str(step + 2),
                      "--checkpoint.dir", str(ckpt))) == 0
    assert [r["step"] for r in _rows(tmp_path / "log2")] == [step + 1, step + 2]


def test_nan_step_is_skipped_and_training_continues(demo_cache_dir: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MEGALITE_FAULT", "nan:step=3")
    assert main(_args(demo_cache_dir, tmp_path / "a", "--train.steps", "6")) == 0
    rows = _rows(tmp_path / "a")
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    assert all(r["loss"] == r["loss"] for r in rows[3:])  # finite afterwards
    monkeypatch.setenv("MEGALITE_FAULT", "nan:step=2-100")
    assert main(_args(demo_cache_dir, tmp_path / "b", "--train.steps", "20", "--train.max_skipped_steps", "2")) == 1
    assert "consecutive steps had a non-finite gradient norm" in capsys.readouterr().err


def test_loss_spike_is_logged(demo_cache_dir: str, tmp_path: Path) -> None:
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "14", "--train.spike_factor", "0.5")) == 0
    rows = _rows(tmp_path)
    assert all("spike" in r for r in rows) and any(r["spike"] for r in rows[10:])  # 0.5 x median: every step spikes


def test_signal_before_step_1_is_honoured(demo_cache_dir: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """SIGTERM while the run is still being built (data, model, checkpoint load): a clean exit 0 before
    step 1, nothing trained, no metrics written; the handlers are restored afterwards by the test."""
    from megalite.training import trainer

    real_build = trainer.build_run

    def build_then_signal(cfg):  # the signal lands mid-build, as a preemption would
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(cfg)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    monkeypatch.setattr(trainer, "build_run", build_then_signal)
    try:
        assert main(["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--train.steps", "3",
                     "--logging.dir", str(tmp_path / "log")]) == 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert "stop requested by signal before step 1" in capsys.readouterr().err
    assert not (tmp_path / "log" / "metrics.jsonl").exists()


def test_second_signal_stops_at_once(monkeypatch) -> None:
    """A second SIGTERM while the first is honoured ends the process at once: exit 128 + 15, no save."""
    import pytest

    from megalite.training.stop import StopFlag

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    with StopFlag() as flag:
        flag._handle(signal.SIGTERM, None)
        assert flag.requested
        with pytest.raises(SystemExit) as stopped:
            flag._handle(signal.SIGTERM, None)
        assert stopped.value.code == 128 + signal.SIGTERM
