"""File-level helpers shared by the checkpoint writers and the tools: names, fsync, checksums, atomic
outputs, pruning, and the check that a name read from a file stays inside its directory.

Atomicity recipe (used by `sharded.py` and `offline.py`): write everything into `step_N.tmp/`,
fsync each file, rename the directory to `step_N`, and only then rewrite the `latest` pointer
(write-temp-then-rename). A crash at any point leaves the previous checkpoint as the one found.
Single files follow the same recipe, never through a link (`atomic_output`, `write_atomic`,
`open_no_link` in megalite/atomic.py: data and logs write files too).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from megalite.atomic import (atomic_output, fsync_dir, fsync_file, make_fresh_dir,  # noqa: F401  (re-exported)
                             open_no_link, refuse_link, temp_name, write_atomic)
from megalite.errors import CheckpointError

LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d{8,})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of_dir_name(name: str) -> int | None:
    """The step of a name megalite's `step_dir_name` wrote (`step_00000012` -> 12); None for any other name
    (`step_00000002.keep`, `step_00000001-good-run`, `step_12`: a user's copies are never taken for ours)."""
    m = _STEP_DIR.fullmatch(name)
    if m is None or step_dir_name(int(m.group(1))) != name:
        return None
    return int(m.group(1))



def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()



def refuse_output_in_checkpoint(out: str | Path, what: str = "output") -> None:
    """An output must not lie inside a saved checkpoint step directory (one holding index.json), its input's
    included: pruning or re-saving that step deletes it, and a reader would take it for part of the step."""
    path = Path(out).expanduser().absolute()
    step = next((q for q in path.parents if (q / "index.json").is_file()), None)
    if step is not None:
        raise CheckpointError(f"{what} {out} lies inside the saved checkpoint {step}: it would be deleted with that "
                              f"step (checkpoint.keep) and mixed into it; write it beside it, e.g. {step.parent}/"
                              f"{path.name}")


def inside(root: Path, name: object, what: str, links_out: bool = False) -> Path:
    """`root / name` for a file name read from a checkpoint's own metadata (index.json, `latest`, an HF
    weight_map), refusing anything that is not a plain name inside `root`: an absolute path, `..`, or (unless
    `links_out`) a link that leads out. Such names never come from megalite's writers. `links_out` is for
    a Hugging Face hub snapshot, whose files are links into `../../blobs`: it is only read, never written."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise CheckpointError(f"{root}: {what} names {name!r}, which is not a file name inside {root}: the "
                              "metadata was edited or comes from elsewhere; refusing to read outside the checkpoint")
    path = root / name
    if not links_out and path.is_symlink() and not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{root}: {what} {name!r} is a link to {path.resolve()}, outside the checkpoint: "
                              "refusing to read it")
    return path


def saved_steps(base: Path) -> dict[int, Path]:
    """The complete step directories megalite wrote in `base`: named exactly `step_%08d` (see
    `step_of_dir_name`), a real directory (not a link) holding an index.json."""
    found: dict[int, Path] = {}
    for p in base.iterdir() if base.is_dir() else ():
        step = step_of_dir_name(p.name)
        if step is not None and not p.is_symlink() and p.is_dir() and (p / "index.json").is_file():
            found[step] = p
    return found


def prune(base: Path, keep: int, current: str | None = None) -> None:
    """Delete all but the `keep` newest complete step directories up to `current` (the one just published).
    Only names megalite writes are candidates (`saved_steps`): a user's `step_00000002.keep` or a link is
    never deleted. Steps after `current` exist only when a run went back on purpose (see
    `claim.claim_directory`); they are left alone, and counting them would delete the checkpoint `latest`
    now names."""
    if keep <= 0:
        return
    limit = step_of_dir_name(current) if current is not None else None
    done = sorted((s, p) for s, p in saved_steps(base).items() if limit is None or s <= limit)
    for _, old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def refuse_foreign_file(path: Path) -> None:
    """A file (not a directory, not a link: `refuse_link` names those) where megalite puts step_N or step_N.tmp
    is the user's: refused before anything is written, and left as it is."""
    if path.exists() and not path.is_dir() and not path.is_symlink():
        raise CheckpointError(f"{path} exists and is a file, not a checkpoint directory: megalite will not replace "
                              "it; move it away or give checkpoint.dir another directory")
