"""File-level helpers shared by the checkpoint writers: names, fsync, checksums, pruning.

Atomicity recipe (used by `sharded.py` and `offline.py`): write everything into `step_N.tmp/`,
fsync each file, rename the directory to `step_N`, and only then rewrite the `latest` pointer
(write-temp-then-rename). A crash at any point leaves the previous checkpoint as the one found.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prune(base: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete step directories."""
    if keep <= 0:
        return
    done = sorted(p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
