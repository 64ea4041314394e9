"""Say what a run is doing before step 1 when it takes a while.

A large model on a small machine can spend minutes building the model, the optimizer's state, the data
index, or in its first step (the first step also pays for warm-up: allocator growth, kernel choice). A
silent terminal for that long looks like a hang. `SlowPhase` stays quiet for a phase that ends within
`after_s` seconds (the small runs, and every test, print nothing new); a longer one prints what it is
doing when `after_s` has passed and how long it took when it ends:

    megalite: building the model and its weights (still running after 5 s)
    megalite: building the model and its weights: done in 41.2 s

The first line comes from a timer thread, so it shows while the phase is still running.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

SLOW_AFTER_S = 5.0  # "a few seconds": quicker phases print nothing


class SlowPhase:
    """A context manager around one phase; prints only when the phase outlasts `after_s` (0: at once)."""

    def __init__(self, what: str, enabled: bool = True, after_s: float = SLOW_AFTER_S,
                 stream: TextIO | None = None) -> None:
        self.what, self.enabled, self.after_s = what, enabled, after_s
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._announced: bool | None = False  # None once the phase has ended
        self._timer: threading.Timer | None = None
        self._t0 = 0.0

    def _announce(self) -> None:
        with self._lock:
            if self._announced is None:  # the phase ended while the timer fired
                return
            self._announced = True
            self.stream.write(f"megalite: {self.what} (still running after {self.after_s:g} s)\n")
            self.stream.flush()

    def __enter__(self) -> SlowPhase:
        self._t0 = time.perf_counter()
        if not self.enabled:
            return self
        if self.after_s <= 0:
            self._announce()
        else:
            self._timer = threading.Timer(self.after_s, self._announce)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            announced, self._announced = self._announced, None
        if announced and exc_type is None:
            self.stream.write(f"megalite: {self.what}: done in {time.perf_counter() - self._t0:.1f} s\n")
            self.stream.flush()
