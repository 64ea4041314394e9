"""Per-rank checkpoints for resuming with the same layout (model, optimizer, data position, RNG).

Layout on disk:
    <dir>/step_00000100/rank_00000.pt ...   one file per rank, written in parallel, no gather
    <dir>/step_00000100/meta.json           step, layout, model dims, file checksums
    <dir>/latest                            name of the newest complete checkpoint

Atomic: every rank writes into `step_N.tmp/`, files are fsynced, then rank 0 renames the directory
and only then rewrites `latest` (write-temp-then-rename). A crash at any point leaves the previous
checkpoint as the one `checkpoint.load=latest` finds. Loading under a different layout is the
resharding checkpoint's job; here it is refused with a clear message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from megalite.errors import CheckpointError

LATEST = "latest"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save(root: str, step: int, rank: int, world_size: int, payload: dict[str, Any], meta: dict[str, Any],
         barrier: Callable[[], None], keep: int) -> Path:
    """Every rank calls this with its own payload; returns the final checkpoint directory."""
    base = Path(root)
    final = base / step_dir_name(step)
    tmp = base / (step_dir_name(step) + ".tmp")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        path = tmp / f"rank_{rank:05d}.pt"
        torch.save(payload, path)
        _fsync_file(path)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint under {base}: {e.strerror or e} "
                              "(check the directory is writable and the disk has space)") from e
    barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size,
                    files={f"rank_{r:05d}.pt": _sha256(tmp / f"rank_{r:05d}.pt") for r in range(world_size)})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _fsync_file(tmp / "meta.json")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = base / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        _fsync_file(pointer)
        os.replace(pointer, base / LATEST)
        _prune(base, keep)
    barrier()
    return final


def _prune(base: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find(load: str, root: str) -> Path | None:
    """Resolve `checkpoint.load`: 'none' -> None; '' or 'latest' -> the newest complete one under `root`
    (None if there is none yet: a fresh start, and what a restarted job finds); otherwise the given
    directory, which must hold a complete checkpoint."""
    if load == "none":
        return None
    if not load:  # auto: resume from the newest complete checkpoint in `root` when there is one
        load = LATEST
    if load == LATEST:
        pointer = Path(root) / LATEST if root else None
        if pointer is None or not pointer.exists():
            return None
        path = Path(root) / pointer.read_text().strip()
    else:
        path = Path(load)
        if (path / LATEST).exists():  # a checkpoint root was given: take its newest
            path = path / (path / LATEST).read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path} is not a complete megalite checkpoint (no meta.json); "
                              "point checkpoint.load at a step_* directory or use 'latest'")
    return path


def load(path: Path, rank: int, expect: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's payload and the metadata, after checking the layout/model match and the checksum."""
    meta = json.loads((path / "meta.json").read_text())
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(f"checkpoint {path} has {key}={meta.get(key)!r} but this run has {value!r}; "
                                  "resume with the same model and layout")
    name = f"rank_{rank:05d}.pt"
    file = path / name
    if not file.exists():
        raise CheckpointError(f"checkpoint {path} has no {name}")
    if _sha256(file) != meta["files"][name]:
        raise CheckpointError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    return torch.load(file, map_location="cpu", weights_only=False), meta
