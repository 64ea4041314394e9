"""Per-step metrics: `<logging.dir>/metrics.jsonl`, a progress line on stdout, wandb, and a summary.

Every field named in the public contract is written on every logged step (null where unknown),
with the loss at full float precision so runs can be compared bit for bit. One file holds one run:
a fresh run moves an existing `metrics.jsonl` aside to `metrics.<n>.jsonl` (n = 1, 2, ... oldest
first), a resumed run keeps it, drops the records after the step it resumed from, and appends. The kept
records go to a new file beside it that is renamed over it when complete (a full disk leaves the old file
whole), and no write goes through a link (`megalite.checkpoint.files`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megalite.atomic import open_no_link, refuse_link, write_atomic
from megalite.errors import ConfigError
from megalite.observability.tracking import Tracker
from megalite.untrusted import loads_json

ETA_WINDOW = 20  # steps whose median time predicts the rest


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark, in bytes.

    On Linux it is /proc/self/status's VmHWM, not `getrusage(RUSAGE_SELF).ru_maxrss`: the kernel carries
    ru_maxrss over fork and exec, so a process started by a large parent (a test runner, a notebook) reports the
    parent's RSS at the fork until it outgrows it (measured: 813 MiB for a child that held 13 MiB). Elsewhere
    ru_maxrss is the only source (macOS reports it in bytes, the other Unixes in KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   13676 kB"
    except OSError:
        pass
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on CUDA; the process's peak RSS elsewhere (`peak_rss_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_rate(per_s: float, unit: str = "tok") -> str:
    """An adaptive unit: 850 tok/s, 12.3k tok/s, 4.56M tok/s (never `0.0k` for a slow run)."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{prefix} {unit}/s"
    return f"{per_s:.3g} {unit}/s"


def format_bytes(n: float) -> str:
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB")):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n / 2**10:.0f} KiB"


def format_step_time(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def start_metrics_file(path: Path, resumed_step: int) -> Path | None:
    """Make `path` hold this run only (see the module doc); returns where an old file was moved."""
    refuse_link(path, ConfigError, hard_links=False)
    if not path.exists():
        return None
    if resumed_step > 0:
        with open(path, encoding="utf-8", errors="replace") as f:
            kept = [line for line in f.read().splitlines()
                    if (step := _step_of(line)) is not None and step <= resumed_step]
        write_atomic(path, "".join(line + "\n" for line in kept).encode(), ConfigError)
        return None
    n = 1
    while os.path.lexists(path.parent / f"{path.stem}.{n}{path.suffix}"):
        n += 1
    rotated = path.parent / f"{path.stem}.{n}{path.suffix}"
    path.rename(rotated)
    return rotated


def _step_of(line: str) -> int | None:
    try:
        step = loads_json(line, "a metrics.jsonl line", ConfigError)["step"]
    except (ValueError, KeyError, TypeError, ConfigError):  # a torn last line of a killed run: dropped
        return None
    return step if type(step) is int else None


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line at the end of metrics.jsonl (never through a link)."""
    with open_no_link(path, "a", ConfigError) as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class RunTotals:
    """What the end-of-run summary reports (rank 0's view; losses are global)."""

    first_step: int = 0
    last_step: int = 0
    final_loss: float = math.nan
    best_loss: float = math.inf
    best_step: int = 0
    valid_loss: float | None = None
    tokens_seen: int = 0
    started: float = field(default_factory=time.perf_counter)


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a disabled logger.

    `step_done` is called every step (it averages the console's rate and step time over the steps
    since the last line); `log` every logged step."""

    def __init__(self, log_dir: str, enabled: bool, tracker: Tracker, total_steps: int,
                 resumed_step: int = 0) -> None:
        self.enabled, self.tracker, self.total_steps = enabled, tracker, total_steps
        self.path = Path(log_dir) / "metrics.jsonl"
        self.rotated: Path | None = None
        self.totals = RunTotals(first_step=resumed_step, last_step=resumed_step)
        self._window_s, self._window_tokens, self._window_steps = 0.0, 0, 0
        self._step_times: list[float] = []  # the last few, for the ETA (a median ignores one slow step)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.rotated = start_metrics_file(self.path, resumed_step)

    def step_done(self, step: int, loss: float, skipped: bool, seconds: float, tokens: int) -> None:
        """Every step: the console's averages, the ETA's step times and the final loss."""
        self._window_s += seconds
        self._window_tokens += tokens
        self._window_steps += 1
        if step > self.totals.first_step + 1:  # the first step warms up (several times slower): not in the ETA
            self._step_times = (self._step_times + [seconds])[-ETA_WINDOW:]
        t = self.totals
        t.last_step, t.tokens_seen = step, t.tokens_seen + tokens
        t.final_loss = loss

    def log(self, record: dict[str, Any]) -> None:
        t = self.totals
        if record.get("valid_loss") is not None:
            t.valid_loss = record["valid_loss"]
        # The summary's best loss is a logged one: its step is a line of metrics.jsonl to look up.
        if not record.get("skipped") and record["loss"] < t.best_loss:
            t.best_loss, t.best_step = record["loss"], record["step"]
        if not self.enabled:
            return
        record = {**record, "timestamp": round(time.time(), 3)}
        append_record(self.path, record)
        self.tracker.log(record, step=record["step"])
        eta = None
        if self._step_times:
            eta = sorted(self._step_times)[len(self._step_times) // 2] * (self.total_steps - record["step"])
        print(self.progress_line(record, eta), flush=True)
        self._window_s, self._window_tokens, self._window_steps = 0.0, 0, 0

    def progress_line(self, record: dict[str, Any], seconds_left: float | None) -> str:
        """Rate and step time are averages over the steps since the previous line; memory is this
        process's peak (rank 0: one device's figure, not the job's)."""
        parts = [f"step {record['step']:>5}/{self.total_steps}", f"loss {record['loss']:.4f}"]
        if record.get("valid_loss") is not None:
            parts.append(f"valid {record['valid_loss']:.4f}")
        parts += [f"lr {record['lr']:.2e}", f"grad {record['grad_norm']:.3f}"]
        if self._window_steps and self._window_s > 0:
            parts += [format_rate(self._window_tokens / self._window_s),
                      f"{format_step_time(self._window_s / self._window_steps)}/step"]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if record.get("mem_peak_bytes"):
            parts.append(f"mem {format_bytes(record['mem_peak_bytes'])}")
        if record.get("skipped"):
            parts.append("SKIPPED (non-finite grad)")
        if seconds_left is not None:
            parts.append(f"ETA {format_duration(seconds_left)}")
        return " | ".join(parts)

    def summary(self, checkpoint: Path | None, log_dir: str) -> str:
        """The end-of-run report: losses, time, tokens, and where everything went."""
        t = self.totals
        steps = t.last_step - t.first_step
        lines = [f"done: {steps} steps (to step {t.last_step}) in {format_duration(time.perf_counter() - t.started)}"
                 f", {t.tokens_seen:,} tokens seen"]
        if steps:
            best = f"best {t.best_loss:.4f} at step {t.best_step}" if math.isfinite(t.best_loss) else "no finite loss"
            lines.append(f"  loss: final {t.final_loss:.4f}, {best}"
                         + (f"; valid {t.valid_loss:.4f}" if t.valid_loss is not None else ""))
        lines.append(f"  outputs: {Path(log_dir) / 'metrics.jsonl'}, {Path(log_dir) / 'config.toml'}"
                     + (f" (previous run's metrics moved to {self.rotated})" if self.rotated else ""))
        lines.append(f"  last checkpoint: {checkpoint}" if checkpoint else
                     "  last checkpoint: none (set checkpoint.dir to save one)")
        return "\n".join(lines)

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)
