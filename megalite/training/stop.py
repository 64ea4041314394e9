"""Stop signals: Ctrl-C (SIGINT), SIGTERM and SIGUSR1 (what Slurm sends before a preemption) -> finish the
step, save, exit 0. A second one means "now": one line, exit 128 + the signal (130 for Ctrl-C).

The handlers are installed before the run builds anything, so a signal that arrives while data is read, the
model is built or a checkpoint is loaded is honoured too: the run stops before step 1 (nothing to save yet).
A step is never cut short by the first signal (every rank must stop at the same step boundary to save a
consistent checkpoint), so the first signal says when the save will come: at the end of the current step,
expected after the last step's measured duration. The second ends the process at once with `os._exit`;
the checkpoint directory's lock is an `flock`, which the kernel releases with the process (the lock file
itself stays, unlocked: the next run takes it). On leaving the `with` block the caller's handlers return.
"""

from __future__ import annotations

import os
import signal
import time
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.state import ParallelState

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _say(text: str) -> None:
    """One line on stderr, safe inside a signal handler (no buffered stream that the interrupted code
    may be in the middle of writing)."""
    try:
        os.write(2, f"megalite: {text}\n".encode())
    except OSError:  # stderr closed (a daemon, a gone terminal): the stop itself must still happen
        pass


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class StopFlag:
    """Installs the handlers on `__enter__` (or construction); `agreed` is polled once per step."""

    def __init__(self, saves: bool = True, rank: int = 0) -> None:
        self.requested = False
        self.saves = saves  # a checkpoint directory is set: the stop saves one
        self._speaks = rank == 0  # one line per job, not one per rank
        self._step: int | None = None  # the last step every rank finished (None: before step 1)
        self._step_end = 0.0  # when it ended (time.monotonic)
        self._step_s: float | None = None  # how long it took, measured between two polls
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def __enter__(self) -> StopFlag:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers that were there before (an embedding program's Ctrl-C works again)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # asked twice: stop now, one line, no traceback, no save
            if self._speaks:
                _say(f"{_name(signum)} again: stopping at once, without saving (exit {128 + signum})")
            os._exit(128 + signum)
        self.requested = True
        if self._speaks:
            _say(self.announcement(signum, time.monotonic()))

    def announcement(self, signum: int, now: float) -> str:
        """What the first signal tells the user: when the run will stop and whether it saves."""
        again = "send it again to stop at once without saving" if signum != signal.SIGINT else \
            "Ctrl-C again stops at once without saving"
        if self._step is None:
            return f"{_name(signum)}: stopping before step 1 (nothing trained yet, nothing to save); {again}"
        what = "saving a checkpoint there" if self.saves else "nothing is saved (checkpoint.dir is empty)"
        if self._step_s is None:
            when = "its duration is not measured yet"
        else:
            left = self._step_s - (now - self._step_end)
            when = (f"expected in about {left:.0f} s" if left >= 1 else "expected any moment") + \
                f" (the last step took {self._step_s:.1f} s)"
        return f"{_name(signum)}: stopping at the end of step {self._step + 1}, {what}; {when}; {again}"

    def agreed(self, state: ParallelState, step: int | None = None) -> bool:
        """Stop only when every rank stops at the same step: all-reduce the flag (MAX). `step` is the step
        just finished (None before step 1); the time between two polls is the step time the first signal
        quotes."""
        now = time.monotonic()
        if step is not None:
            if self._step is not None:
                self._step_s = now - self._step_end
            self._step, self._step_end = step, now
        if state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=state.device)
        comm.all_reduce(flag, state, "mp", op=dist.ReduceOp.MAX, count_as="metrics")
        flag_all = torch.tensor([flag.item()], device=state.device)
        comm.all_reduce(flag_all, state, "dp_cp", op=dist.ReduceOp.MAX, count_as="metrics")  # mp x dp_cp: all
        return bool(flag_all.item())

    def started(self, step: int) -> None:
        """The loop is about to run step `step + 1` (after a resume, `step` is the loaded one)."""
        self._step, self._step_end = step, time.monotonic()

