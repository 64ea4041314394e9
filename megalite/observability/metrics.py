"""Per-step metrics: `<logging.dir>/metrics.jsonl`, a progress line on stdout, and wandb.

Every field named in the public contract is written on every logged step (null where unknown),
with the loss at full float precision so runs can be compared bit for bit.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from megalite.observability.tracking import Tracker


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on CUDA; the process's peak RSS elsewhere (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a disabled logger."""

    def __init__(self, log_dir: str, enabled: bool, tracker: Tracker, total_steps: int) -> None:
        self.enabled, self.tracker, self.total_steps = enabled, tracker, total_steps
        self.path = Path(log_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any], seconds_left: float | None = None) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log(record, step=record["step"])
        parts = [f"step {record['step']:>5}/{self.total_steps}", f"loss {record['loss']:.4f}"]
        if record.get("valid_loss") is not None:
            parts.append(f"valid {record['valid_loss']:.4f}")
        parts += [f"lr {record['lr']:.2e}", f"grad {record['grad_norm']:.3f}",
                  f"{record['tokens_per_s'] / 1e3:.1f}k tok/s"]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if record.get("skipped"):
            parts.append("SKIPPED (non-finite grad)")
        if seconds_left is not None:
            parts.append(f"ETA {format_duration(seconds_left)}")
        print(" | ".join(parts), flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)
