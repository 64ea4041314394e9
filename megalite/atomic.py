"""Link-safe, atomic single-file writes: the base every writer of megalite uses (checkpoints, logs, data
files, tokenizer models, plots).

Atomic: a temporary name in the same directory (so the rename cannot cross file systems), fsync, rename; on
failure only that temporary file is removed, and the file the user had is left exactly as it was.

Links: a directory megalite writes into may come from someone else, so nothing here writes *through* a link
found inside it. Files are opened with O_NOFOLLOW (the kernel refuses a symbolic link, no check-then-open
race) and refused when they are not plain files with a single name (a hard link to a file elsewhere would be
rewritten too); a link where megalite would write, rename or delete is a one-line error, never followed.
Reading through links is fine (a Hugging Face cache links its weights into `../../blobs`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from megalite.errors import CheckpointError, MegaliteError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _link_error(path: Path, error: type[MegaliteError]) -> MegaliteError:
    try:
        where = f" to {os.readlink(path)}"
    except OSError:
        where = ""
    return error(f"{path} is a link{where}: megalite never writes through a link inside a directory it writes "
                 "to (it could overwrite a file elsewhere); remove the link or choose another directory")


def refuse_link(path: str | Path, error: type[MegaliteError] = CheckpointError, hard_links: bool = True) -> None:
    """Raise `error` when `path` is a symbolic link or (with `hard_links`, for a file rewritten in place) a
    file of several hard links: writing there would change a file elsewhere. A missing path is fine.
    A rename over a name replaces only that name, so `atomic_output` passes hard_links=False."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _link_error(path, error)
    if hard_links and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise error(f"{path} has {st.st_nlink} hard links: rewriting it would change the other names too; "
                    "remove this name or choose another directory")


def open_no_link(path: str | Path, mode: str = "wb", error: type[MegaliteError] = CheckpointError,
                 exclusive: bool = False) -> IO:
    """`open(path, mode)` for writing ("wb", "ab", "a+", "w", "a") that refuses a link (see the module doc).
    `exclusive`: the file must not exist yet. Truncation ("w") happens only after the checks."""
    path = Path(path)
    refuse_link(path, error)
    flags = os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= os.O_RDWR if "+" in mode else os.O_WRONLY
    flags |= os.O_APPEND if "a" in mode else 0
    flags |= os.O_EXCL if exclusive else 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # the kernel found a link at the last component
            raise _link_error(path, error) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise error(f"{path} is not a plain file of one name (a device, pipe or hard link): megalite "
                        "writes only its own files there; remove it or choose another directory")
        os.set_blocking(fd, True)
        if "w" in mode:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode)  # wraps the checked descriptor: nothing is reopened by name
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str | Path, data: bytes, error: type[MegaliteError] = CheckpointError) -> None:
    """Replace `path` by `data` (temporary name beside it, fsync, rename), never through a link."""
    with atomic_output(path, error) as tmp:
        with open_no_link(tmp, "wb", error, exclusive=True) as f:
            f.write(data)


def make_fresh_dir(path: Path, error: type[MegaliteError] = CheckpointError) -> None:
    """Create `path` empty: a leftover directory of the same (megalite-made) name is removed first; a link
    there is refused, never followed."""
    refuse_link(path, error)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


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
def atomic_output(path: str | Path, error: type[MegaliteError] = CheckpointError) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s new content to; on success it is fsynced and renamed over
    `path`, on any error it is removed and `path` is left exactly as it was. A link at `path` is refused
    before anything is written; a stale entry at the temporary name (this pid's) is removed, not followed."""
    path = Path(path)
    tmp = temp_name(path)
    refuse_link(path, error, hard_links=False)
    if os.path.lexists(tmp):
        tmp.unlink()  # removing a link removes the link, not its target
    try:
        yield tmp
        refuse_link(tmp, error)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) == str(tmp):
            e.filename = str(path)  # name the file the user asked for, not our temporary one
        raise
    fsync_dir(path.parent)
