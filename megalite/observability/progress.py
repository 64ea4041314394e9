"""A tiny, dependency-free progress bar for long CPU jobs (tokenizing, preprocessing).

Prints `desc: done/total unit  rate unit/s  ETA h:mm:ss` to stderr, at most once every
`min_interval` seconds, so that tokenizing millions of documents does not spend its time printing.
The rate is counted from the first finished item, not from the start: a pool of workers that takes a
minute to start (each imports its libraries and loads the tokenizer) would otherwise read as
"0.0 docs/s" for that minute and an ETA far too long after it; the start-up time is shown instead.
On a terminal it redraws one line with `\\r`; in a log file (not a TTY) it writes whole lines, less
often, so that logs stay readable.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts work items and prints a throttled status line.

    Use as a context manager (`with Progress(n, "tokenizing", "docs") as bar: bar.update()`), or call
    `close()` yourself: the final line with the total time is printed on close.
    """

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "it",
                 min_interval: float = 0.5, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        # Without a terminal every print is a new line: print ten times less often.
        self.min_interval = min_interval if self.is_tty else min_interval * 20
        self.count = 0
        self.start = time.monotonic()
        self._first: float | None = None  # when the first item finished (the rate is counted from there)
        self._at_first = 0  # items counted by then
        self._last_print = self.start
        self._closed = False
        self._print()  # "starting": something on screen before the first item (a pool may take a while)

    def line(self) -> str:
        """The current status line (without the carriage return)."""
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        done = f"{self.count}/{self.total}" if self.total is not None else f"{self.count}"
        text = f"{self.desc}: {done} {self.unit}"
        rate = 0.0
        if self._first is None:
            text += "  starting"
        elif now - self._first < 1e-3 or self.count == self._at_first:
            text += f"  first after {self._first - self.start:.1f} s"
        else:
            rate = (self.count - self._at_first) / (now - self._first)
            text += f"  {rate:,.1f} {self.unit}/s (first after {self._first - self.start:.1f} s)"
        if self.total is not None and rate > 0 and self.count < self.total:
            text += f"  ETA {_fmt_duration((self.total - self.count) / rate)}"
        else:
            text += f"  elapsed {_fmt_duration(elapsed)}"
        return text

    def _print(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.is_tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        """Add `n` finished items; prints if `min_interval` has passed since the last print."""
        self.count += n
        now = time.monotonic()
        if self._first is None and self.count > 0:
            self._first, self._at_first = now, self.count
        if now - self._last_print >= self.min_interval:
            self._last_print = now
            self._print()

    def close(self) -> None:
        """Print the final line once."""
        if not self._closed:
            self._closed = True
            self._print(final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
