"""Raw data files read whole or refused: their kinds, directory listings, verified decompression, fingerprints.

Shared by streaming (megalite/data/sources.py) and preprocessing (megalite/data/documents.py), so both take the
same files and refuse the same ones:

  * a file's kind is read from its suffix (`SUFFIXES`); a directory means every file of a known kind in it
    (not its subdirectories), and what it also holds is named in one note (`Listing.skipped`);
  * only regular files are read: a FIFO (which would block the reader forever), a device or a socket is refused
    before anything is read;
  * a compressed file is decompressed member by member (gzip) / frame by frame (zstd) and must end at the end of
    a complete one: a file cut in the middle of a frame is a DataError naming the file and the compressed offset,
    never a clean end of file (the zstd library's own stream reader returns a silent EOF there);
  * `content_digest` fingerprints a file's bytes, so a resumed run can tell a file rewritten to the same size.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Literal

from megalite.errors import DataError

Kind = Literal["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"]
SUFFIXES: dict[str, Kind] = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
                             ".jsonl.zst": "jsonl.zst", ".json.zst": "jsonl.zst", ".parquet": "parquet"}
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what datasets' save_to_disk writes
_CHUNK = 1 << 16
# zstd has no output bound per call: a small input chunk bounds what one call can inflate to (zstd's largest
# ratio is about 1:43,000, so 2 KiB -> at most ~90 MB).
_ZSTD_CHUNK = 2048


def file_kind(path: str) -> Kind | None:
    """The kind of a file from its suffix (the longest that matches), or None."""
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if path.endswith(suffix):
            return kind
    return None


def _special(mode: int) -> str | None:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return None


def check_regular(path: str, what: str = "data.path") -> None:
    """A DataError unless `path` is a regular file (following links): a FIFO would block the reader forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{what} {path!r}: no such file") from None
    except OSError as e:
        raise DataError(f"{what} {path!r}: cannot be read ({e.strerror})") from None
    special = _special(mode)
    if special is not None:
        raise DataError(f"{what} {path!r} is {special}, not a regular file: data is read from files only (a pipe "
                        "would block the run; copy the data into a file)")
    if not stat.S_ISREG(mode):
        raise DataError(f"{what} {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{what} {path!r} cannot be read (permission denied): check its permissions")


@dataclass
class Listing:
    """The data files of a `data.path` entry, in sorted order, and what a directory held besides them."""

    files: list[str]
    skipped: list[str] = field(default_factory=list)  # "name (why)"

    def note(self, path: str) -> str | None:
        if not self.skipped:
            return None
        return (f"data.path {path!r}: read {len(self.files)} file(s); skipped {len(self.skipped)}: "
                + ", ".join(self.skipped))


def list_directory(path: str) -> Listing:
    """Every file of a known kind in directory `path` (sorted by name); special files are refused, and other
    entries (subdirectories, files of other kinds, hidden files) are listed as skipped, with why."""
    files, skipped = [], []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        try:
            mode = os.stat(full).st_mode
        except OSError as e:
            skipped.append(f"{name} ({e.strerror})")
            continue
        if stat.S_ISDIR(mode):
            skipped.append(f"{name}/ (a subdirectory: not read)")
        elif name.startswith("."):
            skipped.append(f"{name} (hidden)")
        elif file_kind(name) is None:
            skipped.append(f"{name} (not .jsonl, .jsonl.gz, .jsonl.zst or .parquet)")
        else:
            check_regular(full, f"data.path {path!r} holds")
            files.append(full)
    return Listing(files, skipped)


class _Verified(io.RawIOBase):
    """The decompressed bytes of `raw`, member after member, checked to end on a complete member."""

    def __init__(self, path: str, raw: BinaryIO, decoder: Callable[[], Any], chunk: int, bounded: bool) -> None:
        self.path, self.raw, self.decoder, self.chunk, self.bounded = path, raw, decoder, chunk, bounded
        self.dec = decoder()
        self.pending = b""     # compressed bytes read but not yet given to the decoder
        self.out = b""         # decompressed bytes, returned from `self.at` on
        self.at = 0
        self.consumed = 0      # compressed bytes read from the file
        self.started = False   # the current member has had input
        self.done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while self.at >= len(self.out) and not self.done:
            self.out, self.at = b"", 0
            self._step(len(buf))
        n = min(len(buf), len(self.out) - self.at)
        buf[:n] = memoryview(self.out)[self.at: self.at + n]
        self.at += n
        return n

    def _step(self, want: int) -> None:
        if self.dec.eof:  # a member ended: what follows it starts the next one
            self.pending = self.dec.unused_data + self.pending
            self.dec, self.started = self.decoder(), False
        if not self.pending:
            self.pending = self.raw.read(_CHUNK)
            self.consumed += len(self.pending)
            if not self.pending:
                if self.started and not self.dec.eof:
                    raise DataError(f"{self.path!r} is truncated: its compressed data ends at byte {self.consumed} in "
                                    "the middle of a frame (an interrupted download or copy?): fetch the file again")
                self.done = True
                return
        data, self.pending = self.pending[: self.chunk], self.pending[self.chunk:]
        try:
            if self.bounded:  # at most `want` bytes out; the input it did not use comes back first next time
                self.out = self.dec.decompress(data, max(want, _CHUNK))
                if not self.dec.eof:  # at the member's end what is left is in unused_data (and also here)
                    self.pending = self.dec.unconsumed_tail + self.pending
            else:
                self.out = self.dec.decompress(data)
        except Exception as e:  # zlib.error, zstandard.ZstdError (not an OSError): a corrupt file either way
            raise DataError(f"{self.path!r}: corrupt compressed data near byte {self.consumed} "
                            f"({type(e).__name__}: {e}): fetch the file again") from None
        self.started = True

    def close(self) -> None:
        self.raw.close()
        super().close()


def _zstd_decoder() -> Any:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def open_bytes(path: str, kind: Kind) -> BinaryIO:
    """`path`'s bytes, decompressed when `kind` says so and checked to end on a complete frame."""
    check_regular(path)
    raw = open(path, "rb")
    if kind == "jsonl.gz":
        return io.BufferedReader(_Verified(path, raw, lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), _CHUNK, True),
                                 _CHUNK)  # type: ignore[return-value]
    if kind == "jsonl.zst":
        try:
            import zstandard  # noqa: F401
        except ImportError as e:  # a dependency of megalite: only a broken install lacks it
            raw.close()
            raise DataError(f"{path!r} is zstd-compressed: pip install zstandard") from e
        return io.BufferedReader(_Verified(path, raw, _zstd_decoder, _ZSTD_CHUNK, False),
                                 _CHUNK)  # type: ignore[return-value]
    return raw


def lines(path: str, kind: Kind, byte: int = 0, max_line: int = 0) -> Iterator[tuple[int, bytes]]:
    """(byte offset in the decompressed stream, line) of a JSON-lines file, blank lines included; `byte` > 0
    seeks there first (plain files only). With `max_line` > 0 a longer line is not held whole: its first
    `max_line + 1` bytes stand for it (a record that long is counted as oversized) and the rest is skipped, so
    a file with no line breaks (a binary file named .jsonl) cannot fill the memory."""
    with open_bytes(path, kind) as f:
        offset = 0
        if byte > 0:
            f.seek(byte)
            offset = byte
        while True:
            line = f.readline(max_line + 1) if max_line > 0 else f.readline()
            if not line:
                return
            here, length = offset, len(line)
            while max_line > 0 and not line.endswith(b"\n") and length > max_line:
                rest = f.readline(_CHUNK)  # the rest of an oversized line, dropped chunk by chunk
                if not rest:
                    break
                length += len(rest)
                if rest.endswith(b"\n"):
                    break
            offset += length
            yield here, line


def content_digest(paths: list[str], whole_below: int = 1 << 20, blocks: int = 64, block: int = 16 << 10) -> str:
    """A hash of the files' bytes: each file whole up to `whole_below` bytes, a larger one by `blocks` blocks of
    `block` bytes spread evenly from its first to its last byte (bounded work on a large corpus; a same-size edit
    between two sampled blocks of a large file is not seen), together with every size."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size};".encode())
        with open(path, "rb") as f:
            if size <= whole_below:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
                continue
            for i in range(blocks):
                f.seek((size - block) * i // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()

