"""A hang watchdog: when a step runs far longer than the median step, say where this rank is stuck
and exit non-zero instead of hanging until the collective timeout (or forever).

Each rank runs its own watchdog, so every rank reports: the ranks blocked in a collective name it
(the comm counter knows the last operation each rank entered), and the rank that never arrived
shows it is elsewhere (compute, I/O, dead peer). torchrun then tears the job down (and restarts it
with --max-restarts).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

from megalite.parallel.counter import CommCounter

EXIT_CODE_HANG = 6


class Watchdog:
    def __init__(self, rank: int, counter: CommCounter, factor: float, min_seconds: float,
                 poll_s: float = 0.5) -> None:
        self.rank, self.counter, self.factor, self.min_seconds = rank, counter, factor, min_seconds
        self._durations: list[float] = []
        self._step: int | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if factor > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="megalite-watchdog")
            self._thread.start()

    def begin_step(self, step: int) -> None:
        with self._lock:
            self._step, self._started = step, time.monotonic()

    def end_step(self) -> None:
        with self._lock:
            if self._step is not None:
                self._durations.append(time.monotonic() - self._started)
                self._durations = self._durations[-50:]
            self._step = None

    def limit(self) -> float | None:
        """Seconds a step may take; None until 3 steps have been timed (the first ones warm up)."""
        if len(self._durations) < 3:
            return None
        return max(self.min_seconds, self.factor * statistics.median(self._durations))

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with self._lock:
                step, started, limit = self._step, self._started, self.limit()
            if step is None or limit is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > limit:
                since = time.monotonic() - self.counter.last_op_time
                print(f"megalite: watchdog: rank {self.rank} step {step} has run {elapsed:.1f}s "
                      f"(limit {limit:.1f}s = {self.factor:g} x median step); last operation entered: "
                      f"{self.counter.last_op}, {since:.1f}s ago. Exiting so the job can be restarted.",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_CODE_HANG)

    def close(self) -> None:
        self._stop.set()
