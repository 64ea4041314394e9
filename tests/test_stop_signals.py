"""Ctrl-C does what SIGTERM does: the run finishes its step, saves and exits 0, saying first when the save
will come (from the measured step time); a second Ctrl-C ends it at once with one line and exit 130,
leaving the checkpoint directory unlocked. Alone and under launch/torchrun.sh (where a terminal's Ctrl-C
reaches the script, which hands it to each worker once)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterator

import pytest

from megalite.training.stop import StopFlag
from tests.conftest import SMALL_RUN, free_port

REPO = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # only a hang reaches it: each wait below ends as soon as its condition holds


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                             "MEGALITE_FAULT", "OMP_NUM_THREADS")}
    return dict(env, PYTHONPATH=str(REPO), **extra)


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, "the run ended before it was signalled"
        assert time.monotonic() < deadline, "no training step logged (hang guard)"
        time.sleep(0.1)


def _read_until(stream: IO[str], needle: str) -> str:
    """stderr lines up to the first holding `needle` (blocking reads: the process writes it or ends)."""
    seen = ""
    for line in stream:
        seen += line
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} never printed; stderr: {seen[-3000:]}")


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test() -> Iterator[None]:
    """A failed test (a hang guard, an assert before the run ended) must not leave its job training."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: torchrun's agent and its workers
            proc.wait()


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    # A session of its own, so the test can signal its process group as a terminal's Ctrl-C does.
    proc = subprocess.Popen(cmd, stdout=open(log / "stdout.txt", "w"), stderr=subprocess.PIPE, text=True,
                            env=_env(**env), cwd=str(REPO), start_new_session=True)
    _STARTED.append(proc)
    return proc


def _run_args(cache: str, log: Path, ckpt: Path) -> list[str]:
    return ["--data.cache_dir", cache, *SMALL_RUN, "--train.steps", "100000", "--logging.dir", str(log),
            "--checkpoint.dir", str(ckpt), "--checkpoint.interval", "0"]


def _unlocked(ckpt: Path) -> bool:
    with open(ckpt / ".megalite.lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def test_ctrl_c_saves_at_the_end_of_the_step_then_twice_stops_at_once(demo_cache_dir: str, tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    log.mkdir()
    proc = _start([sys.executable, str(REPO / "pretrain.py"), *_run_args(demo_cache_dir, log, ckpt)], log)
    _wait_for_steps(log / "metrics.jsonl", proc, 3)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=HANG_GUARD_S)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "SIGINT: stopping at the end of step" in err and "saving a checkpoint there" in err
    assert "the last step took" in err and "Ctrl-C again stops at once" in err
    saved = int((ckpt / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= 3 and f"stop requested by signal: exiting cleanly after step {saved}" in \
        (log / "stdout.txt").read_text()
    assert _unlocked(ckpt)

    # Twice: the second Ctrl-C ends the (resumed) run at once, one line, exit 130, lock released.
    proc = _start([sys.executable, str(REPO / "pretrain.py"), *_run_args(demo_cache_dir, log, ckpt)], log)
    _wait_for_steps(log / "metrics.jsonl", proc, saved + 2)
    assert proc.stderr is not None
    os.killpg(proc.pid, signal.SIGINT)
    first = _read_until(proc.stderr, "SIGINT: stopping")
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.communicate(timeout=HANG_GUARD_S)[1]
    assert proc.returncode == 130, first + rest
    assert rest.strip().splitlines() == ["megalite: SIGINT again: stopping at once, without saving (exit 130)"]
    assert "Traceback" not in first + rest
    assert _unlocked(ckpt)


def test_ctrl_c_under_launch_torchrun_saves_once_and_exits_0(demo_cache_dir: str, tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    log.mkdir()
    args = [*_run_args(demo_cache_dir, log, ckpt), "--parallel.dp", "2"]
    proc = _start(["bash", str(REPO / "launch/torchrun.sh"), *args], log, NPROC="2", PYTHON=sys.executable,
                  MASTER_PORT=str(free_port()))
    _wait_for_steps(log / "metrics.jsonl", proc, 2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the script's process group
    err = proc.communicate(timeout=HANG_GUARD_S)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and err.count("SIGINT: stopping at the end of step") == 1, err[-3000:]
    assert (ckpt / "latest").is_file() and _unlocked(ckpt)


def test_announcement_quotes_the_measured_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from megalite.parallel.state import ParallelState

    alone = ParallelState()
    with StopFlag(saves=True) as flag:
        assert "stopping before step 1" in flag.announcement(signal.SIGTERM, 0.0)
        clock = iter([100.0, 130.0])
        monkeypatch.setattr(time, "monotonic", lambda: next(clock))
        flag.started(4)  # resumed at step 4, at t = 100
        assert not flag.agreed(alone, 5)  # step 5 ended at t = 130: steps take 30 s
        monkeypatch.undo()
        text = flag.announcement(signal.SIGTERM, 142.0)
        assert "end of step 6" in text and "about 18 s" in text and "took 30.0 s" in text
        assert "send it again" in text
        assert "expected any moment" in flag.announcement(signal.SIGINT, 200.0)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back
