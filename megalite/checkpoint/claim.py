"""A run's claim on its directories: one run per checkpoint.dir (and logging.dir), never rewound.

Before step 1 `claim_directory` makes checkpoint.dir this run's: writable (probed with a real write), not in
use by another run (an exclusive `flock` on `.megalite.lock`, held until the process ends), free of links
planted where the run will write, and not silently rewound to an earlier step. Rank 0 checks; the verdict is
shared so every rank stops together. `claim_log_directory` does the same for logging.dir. The slab files the
run then writes there are `storage.py`'s.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO, Callable

import torch
import torch.distributed as dist

from megalite.checkpoint.files import LATEST, open_no_link, refuse_link, saved_steps, step_of_dir_name
from megalite.errors import CheckpointError, ConfigError, MegaliteError
from megalite.parallel.state import ParallelState

LOCK_FILE = ".megalite.lock"


class DirectoryClaim:
    """Held for the run's lifetime: the open, `flock`ed lock file. The kernel releases the lock when the
    process ends, however it ends (a crash or SIGKILL never leaves the directory stuck)."""

    def __init__(self, handle: IO[str] | None) -> None:
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def newest_step(directory: Path) -> int:
    """The newest complete step saved in `directory` (its `latest` or a step_* with an index.json); -1 if none."""
    steps = list(saved_steps(directory))
    pointer = directory / LATEST
    if pointer.is_file():
        step = step_of_dir_name(pointer.read_text(errors="replace").strip())
        steps += [step] if step is not None else []
    return max(steps, default=-1)


def _lock(directory: Path, what: str = "checkpoint.dir",
          error: type[MegaliteError] = CheckpointError) -> IO[str]:
    handle = open_no_link(directory / LOCK_FILE, "a+", error)  # a link there is refused, never rewritten
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown owner"
        handle.close()
        raise error(f"{what} {directory} is in use by another run ({owner}): two runs would interleave their "
                    f"files; wait for it to end or choose another {what}")
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
    handle.flush()
    return handle


def _refuse_planted_links(directory: Path) -> None:
    """Every name a run writes, renames over or prunes in its checkpoint directory (`latest`, its temporary
    name, `step_N`, `step_N.tmp`) must not be a link: refused here, before step 1 and on every rank (the
    writers check again), so a directory from someone else cannot redirect a save to a file elsewhere."""
    for entry in directory.iterdir():
        name = entry.name
        ours = name in (LATEST, LOCK_FILE) or name.startswith(f".{LATEST}.tmp-") \
            or step_of_dir_name(name.removesuffix(".tmp")) is not None
        if ours:
            refuse_link(entry, hard_links=False)


def _probe_writable(directory: Path) -> None:
    probe = directory / f".megalite.write-test-{os.getpid()}"
    if os.path.lexists(probe):
        probe.unlink()  # a stale one of this pid (or a link planted there: removed, not followed)
    try:
        with open_no_link(probe, "wb", exclusive=True) as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.lexists(probe):
            probe.unlink()


def _claim_on_rank0(directory: Path, start_step: int, resume_from: Path | None) -> DirectoryClaim:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = _lock(directory)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir {directory} cannot be created or written ({e.strerror or e}): "
                              "choose a writable directory") from e
    claim = DirectoryClaim(handle)
    try:
        _refuse_planted_links(directory)
        _probe_writable(directory)
        newest = newest_step(directory)
        rewind_asked = resume_from is not None and resume_from.resolve().parent == directory.resolve()
        if newest > start_step and not rewind_asked:
            raise CheckpointError(
                f"checkpoint.dir {directory} already holds step {newest} but this run starts at step {start_step}: "
                f"it would overwrite that run's checkpoints and move `latest` back; resume it (checkpoint.load "
                f"latest), choose another checkpoint.dir, or load an earlier step of it explicitly "
                f"(checkpoint.load {directory}/step_...) to go back on purpose")
    except OSError as e:
        claim.release()
        raise CheckpointError(f"checkpoint.dir {directory} is not writable ({e.strerror or e}): fix its permissions "
                              "or free disk space before training, or choose another directory") from e
    except BaseException:
        claim.release()
        raise
    return claim


def claim_directory(directory: str, start_step: int, resume_from: Path | None,
                    state: ParallelState) -> DirectoryClaim:
    """Make `directory` this run's checkpoint directory before step 1, or raise CheckpointError: it must be
    writable (probed with a real write), not in use by another run (an exclusive lock held until this
    process ends), and never silently rewound (a run starting at an earlier step than the directory
    holds is refused unless it loaded that earlier step from this same directory). Every rank calls it;
    rank 0 checks and the verdict is shared, so no rank trains while another has refused."""
    if not directory:
        return DirectoryClaim(None)
    return _rank0_verdict(state, lambda: _claim_on_rank0(Path(directory), start_step, resume_from), CheckpointError,
                          f"rank 0 refused checkpoint.dir {directory} (its message says why)")


def claim_log_directory(log_dir: str, checkpoint_dir: str, state: ParallelState) -> DirectoryClaim:
    """Lock `logging.dir` for this run (rank 0 writes there; the verdict is shared), so that a second run
    with the same logging.dir is refused (ConfigError) before it rotates or rewrites the live run's
    metrics.jsonl and config.toml. Nothing to do when it is the checkpoint directory (already locked)."""
    if not log_dir or (checkpoint_dir and Path(log_dir).resolve() == Path(checkpoint_dir).resolve()):
        return DirectoryClaim(None)

    def attempt() -> DirectoryClaim:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        return DirectoryClaim(_lock(Path(log_dir), "logging.dir", ConfigError))

    return _rank0_verdict(state, attempt, ConfigError, f"rank 0 refused logging.dir {log_dir} (its message says why)")


def _rank0_verdict(state: ParallelState, attempt: Callable[[], DirectoryClaim], error: type[MegaliteError],
                   fallback: str) -> DirectoryClaim:
    """Run `attempt` on rank 0 and share whether it refused (an `error`), so every rank stops together."""
    claim, problem = DirectoryClaim(None), ""
    if state.rank == 0:
        try:
            claim = attempt()
        except error as e:
            if state.world_size == 1:
                raise
            problem = str(e)
    if state.world_size > 1:
        flag = torch.tensor([float(bool(problem))], device=state.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise error(problem or fallback)
    return claim
