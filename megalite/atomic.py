"""Atomic single-file writes: a temporary name in the same directory (so the rename cannot cross file
systems), fsync, rename; on failure only that temporary file is removed. Used by everything that writes
a file a reader may open at any moment (checkpoints, tokenizer models, plots); megalite/checkpoint/files.py
builds the checkpoint directories' recipe on it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. some network file systems): the rename itself already happened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A temporary name next to `path` that no user file and no concurrent writer has: `.name.tmp-<pid>`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s new content to; on success it is fsynced and renamed over
    `path`, on any error it is removed and `path` is left exactly as it was."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) == str(tmp):
            e.filename = str(path)  # name the file the user asked for, not our temporary one
        raise
    fsync_dir(path.parent)
