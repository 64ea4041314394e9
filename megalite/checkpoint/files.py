"""File-level helpers shared by the checkpoint writers and the tools: names, fsync, checksums, atomic
outputs, pruning, and the check that a name read from a file stays inside its directory.

Atomicity recipe (used by `sharded.py` and `offline.py`): write everything into `step_N.tmp/`,
fsync each file, rename the directory to `step_N`, and only then rewrite the `latest` pointer
(write-temp-then-rename). A crash at any point leaves the previous checkpoint as the one found.
Single files follow the same recipe (`atomic_output`, in megalite/atomic.py: data writes files too).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from megalite.atomic import atomic_output, fsync_dir, fsync_file, temp_name  # noqa: F401  (re-exported)
from megalite.errors import CheckpointError

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def inside(root: Path, name: object, what: str) -> Path:
    """`root / name` for a file name read from a checkpoint's own metadata (index.json, `latest`, an HF
    weight_map), refusing anything that is not a plain name inside `root`: an absolute path, `..`, or a
    link that leads out. Such names never come from megalite's writers."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise CheckpointError(f"{root}: {what} names {name!r}, which is not a file name inside {root}: the "
                              "metadata was edited or comes from elsewhere; refusing to read outside the checkpoint")
    path = root / name
    if path.is_symlink() and not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{root}: {what} {name!r} is a link to {path.resolve()}, outside the checkpoint: "
                              "refusing to read it")
    return path


def prune(base: Path, keep: int, current: str | None = None) -> None:
    """Delete all but the `keep` newest complete step directories up to `current` (the one just published).
    Steps after `current` exist only when a run went back on purpose (see `storage.claim_directory`); they
    are left alone, and counting them would delete the checkpoint `latest` now names."""
    if keep <= 0:
        return
    done = sorted(p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (current is None or p.name <= current))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
