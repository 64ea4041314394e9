"""Which checkpoint to load, and its index: `checkpoint.load` resolved to a step directory (through a root's
`latest` pointer, never out of the root), and that directory's index.json read and checked field by field
(`megalite.checkpoint.index_check`) before anything trusts it. The format itself: `megalite.checkpoint.sharded`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megalite.checkpoint.files import LATEST, inside
from megalite.checkpoint.index_check import check_index
from megalite.errors import CheckpointError
from megalite.untrusted import loads_json

INDEX = "index.json"
FORMAT = "megalite-sharded-1"


def find(load: str, root: str) -> Path | None:
    """Resolve `checkpoint.load` to a directory holding
    index.json: 'none' -> None; '' or 'latest' -> newest under `root` (None if none yet); a checkpoint
    root (with a `latest` pointer) -> its newest; else the directory itself."""
    if load == "none":
        return None
    if not load or load == LATEST:
        pointer = Path(root) / LATEST if root else None
        if pointer is None or not pointer.exists():
            return None
        path = _follow_latest(Path(root))
    else:
        path = Path(load)
        if (path / LATEST).exists():
            path = _follow_latest(path)
    if not (path / INDEX).is_file():
        raise CheckpointError(f"{path} is not a complete megalite checkpoint (no {INDEX}); point checkpoint.load "
                              "at a step_* directory, a checkpoint root with a `latest` file, or use 'latest'")
    return path


def _follow_latest(root: Path) -> Path:
    """The step directory named by `root/latest`, which must be a name inside `root`."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {root / LATEST} ({e}): point checkpoint.load at a step_* directory") from e
    return inside(root, name, f"{LATEST} pointer")


def read_index(path: Path) -> dict[str, Any]:
    """index.json of a checkpoint, checked field by field (see `megalite.checkpoint.index_check`)."""
    try:
        index = loads_json((Path(path) / INDEX).read_text(encoding="utf-8"), str(Path(path) / INDEX),
                           CheckpointError)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {Path(path) / INDEX} ({e}): not a complete megalite checkpoint; "
                              "load an earlier one") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{path} has checkpoint format {found!r}, expected {FORMAT!r}")
    check_index(index, Path(path))
    return index
