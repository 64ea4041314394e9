"""Raw record sources read as they come: JSON lines (plain, .gz, .zst), parquet, and Hugging Face datasets.

A source is a list of files (a file, or every data file of a directory, of any of the kinds, sorted by name:
megalite/data/readers.py lists them, refuses special files and verifies compressed ones to their end) read
record by record. A record's position is `RecordPos(epoch, file, record, byte)`: the epoch, the index of its
file in that epoch's file order, its index in the file and, for plain JSON lines only, its byte offset (so
resuming seeks there; compressed files are decompressed from their start and the lines before it skipped,
parquet and datasets jump by row index). What a record holds is not interpreted here: a JSON line is handed on as its raw bytes and a
table row as the value of its column, so decoding, parsing and tokenizing happen in the tokenizer workers
(megalite/data/encode.py), which also classify the bad ones.

Which stream a record feeds (`Selection`): streams are a fixed number V of independent, deterministic record
sequences that do not depend on the run's layout (megalite/data/stream.py). Record i of file f goes to stream
`(i + rot(f, epoch)) % V` (a seeded rotation per file and epoch, so a corpus of many one-record files still
spreads over every stream), and to the validation split when a seeded hash of (f, i) falls below
`data.valid_fraction`. Epoch e reads the files in a seeded permutation of their sorted order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from megalite.data.readers import (HF_MARKERS, Listing, check_regular, content_digest, file_kind, lines,
                                   list_directory)
from megalite.errors import ConfigError, DataError, one_line

PathKind = Literal["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf", "dir"]
MISSING = object()  # a table row without the column: the worker counts it as `missing_key`
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A 64-bit mixing function (Steele et al. 2014's SplitMix): seeded hashes of record indices, cheap in Python."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class RecordPos:
    """Where a record is: epoch, index in the epoch's file order, index in the file, byte offset (-1: none)."""

    epoch: int
    file: int
    record: int
    byte: int = -1

    def to_list(self) -> list[int]:
        return [self.epoch, self.file, self.record, self.byte]

    @classmethod
    def of(cls, value: list[int]) -> RecordPos:
        epoch, file, record, byte = (int(v) for v in value)
        return cls(epoch, file, record, byte)


START = RecordPos(0, 0, 0, 0)


def kind_of(path: str) -> PathKind | None:
    """The streaming kind of a `data.path` entry, or None for a `.bin`/`.idx` prefix. A directory is a datasets
    save_to_disk directory ("hf") or a directory of data files ("dir"), never a prefix."""
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, n)) for n in HF_MARKERS):
            return "hf"
        return None if os.path.exists(path + ".idx") else "dir"  # `data/web` beside data/web.idx: the prefix
    kind = file_kind(path)
    if kind is not None:
        return kind
    if path.startswith("hf:"):
        return "hf"
    return None


def is_streaming(path: str) -> bool:
    return kind_of(path) is not None


def _parquet_file(path: str) -> Any:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    check_regular(path)
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError: a cut or foreign file
        raise DataError(f"{path!r} is not a readable parquet file ({type(e).__name__}: {one_line(str(e))}): a "
                        "truncated copy has no footer; fetch the file again") from None


def list_files(path: str, kind: PathKind) -> Listing:
    """The files `path` stands for, each checked to be a regular file (a parquet file's footer read too), so a
    FIFO, a device or a cut parquet file is refused before the run, not met by the loader."""
    if kind == "hf":
        return Listing([path])
    if kind == "dir":
        listing = list_directory(path)
        if not listing.files:
            raise DataError(f"data.path {path!r}: the directory holds no .jsonl, .jsonl.gz, .jsonl.zst or .parquet "
                            "file" + (f" (it holds {', '.join(listing.skipped)})" if listing.skipped else ""))
    elif not os.path.lexists(path):
        raise DataError(f"data.path {path!r}: no such file (a .jsonl/.jsonl.gz/.jsonl.zst/.parquet file, a "
                        "directory of them, a datasets save_to_disk directory, or hf:NAME of a cached dataset)")
    else:
        listing = Listing([path])
    for f in listing.files:
        check_regular(f)
        if file_kind(f) == "parquet":
            _parquet_file(f)
    return listing


def _load_hf(path: str) -> Any:
    """A datasets.Dataset from a save_to_disk directory, or `hf:NAME[:SPLIT]` from the local cache only."""
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError as e:
        raise DataError(f"data.path {path!r} is a Hugging Face dataset: pip install datasets") from e
    if not path.startswith("hf:"):
        try:
            ds = datasets.load_from_disk(path)
        except (OSError, ValueError, FileNotFoundError) as e:
            raise DataError(f"cannot read the datasets directory {path!r} ({e}): write it with save_to_disk") from e
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path!r} is a DatasetDict without a 'train' split (has {sorted(ds)}): save one split")
            ds = ds["train"]
        return ds
    import huggingface_hub.constants as hub

    name, _, split = path[3:].partition(":")
    # Training never downloads: offline mode (read at import, so set on the loaded modules) makes a dataset
    # the local cache lacks fail at once instead of retrying the network.
    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # datasets raises many kinds (ConnectionError, FileNotFoundError, ValueError...)
        raise DataError(f"data.path {path!r}: dataset {name!r} is not in the local Hugging Face cache ({type(e).__name__}); "
                        "training reads no network: download it beforehand, or save_to_disk and pass the "
                        "directory") from e
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


@dataclass
class Source:
    """One `data.path` entry that is read as raw records. `key` is the column / JSON key read. `skipped` names
    what a directory held besides its data files (a note for the log)."""

    path: str
    kind: PathKind
    files: list[str]
    key: str
    seed: int
    skipped: str | None = None
    max_line: int = 0  # data.max_record_bytes: a longer JSON line is read as its first max_line + 1 bytes

    @classmethod
    def open(cls, path: str, key: str, seed: int, max_line: int = 0) -> Source:
        kind = kind_of(path)
        if kind is None:
            raise ConfigError(f"data.path {path!r} is not a streaming source")
        listing = list_files(path, kind)
        src = cls(path, kind, listing.files, key, seed, listing.note(path), max_line)
        if kind == "hf":
            src._hf = _load_hf(path)
        return src

    _hf: Any = None

    def fingerprint(self) -> dict[str, Any]:
        """What must be the same for a saved position to mean the same records (checked on resume): the files,
        their sizes and a digest of each one's content (megalite/data/readers.py `content_digest`)."""
        if self.kind == "hf":
            cached = sorted(str(c["filename"]) for c in getattr(self._hf, "cache_files", []) or [])
            return {"path": self.path, "kind": self.kind, "files": 1, "sizes": [len(self._hf)],
                    "names": [self.path], "content": [content_digest(cached) if cached else ""]}
        names = [os.path.relpath(f, self.path) if self.kind == "dir" else os.path.basename(f) for f in self.files]
        return {"path": self.path, "kind": self.kind, "files": len(self.files),
                "sizes": [os.path.getsize(f) for f in self.files], "names": names,
                "content": [content_digest([f]) for f in self.files]}

    def file_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.files))

    def records(self, file_id: int, start: int, byte: int) -> Iterator[tuple[int, int, Any]]:
        """(record index, byte offset or -1, raw) of file `file_id` from record `start` on."""
        if self.kind == "hf":
            yield from self._hf_rows(start)
            return
        path = self.files[file_id]
        kind = file_kind(path)
        if kind == "parquet":
            yield from self._parquet_rows(path, start)
        elif kind is not None:
            plain = kind == "jsonl"
            seek = byte if plain and byte > 0 else 0
            index = start if seek else 0
            for offset, line in lines(path, kind, seek, self.max_line):
                if not line.strip():
                    continue  # a blank line is no record (a trailing newline, a separator)
                if index >= start:
                    yield index, offset if plain else -1, line
                index += 1

    def _parquet_rows(self, path: str, start: int) -> Iterator[tuple[int, int, Any]]:
        pf = _parquet_file(path)
        has_key = self.key in pf.schema_arrow.names
        first = 0
        for g in range(pf.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            if first + rows <= start:
                first += rows
                continue
            try:
                values = pf.read_row_group(g, columns=[self.key]).column(0).to_pylist() if has_key else [MISSING] * rows
            except Exception as e:  # pyarrow's errors: a row group that does not decode
                raise DataError(f"{path!r}: row group {g} does not decode ({type(e).__name__}: {one_line(str(e))}): "
                                "the file is damaged; fetch it again") from None
            for j in range(max(0, start - first), rows):
                yield first + j, -1, values[j]
            first += rows

    def _hf_rows(self, start: int, batch: int = 1024) -> Iterator[tuple[int, int, Any]]:
        ds = self._hf
        has_key = self.key in ds.column_names
        for lo in range(start, len(ds), batch):
            hi = min(lo + batch, len(ds))
            values = ds.select_columns([self.key])[lo:hi][self.key] if has_key else [MISSING] * (hi - lo)
            for j, value in enumerate(values):
                yield lo + j, -1, value

    def __getstate__(self) -> dict[str, Any]:  # the Dataset is re-opened, not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hf"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.kind == "hf":
            self._hf = _load_hf(self.path)


@dataclass(frozen=True)
class Selection:
    """Which records one stream reads: stream `stream` of `streams`, the train or the validation split."""

    stream: int
    streams: int
    valid: bool
    valid_fraction: float
    seed: int

    def mine(self, file_id: int, record: int, epoch: int) -> bool:
        if self.valid_fraction > 0:
            u = splitmix64(splitmix64(self.seed * 1_000_003 + file_id) ^ record) / 2.0 ** 64
            if (u < self.valid_fraction) != self.valid:
                return False
        elif self.valid:
            return False
        rot = splitmix64(splitmix64(self.seed + 7919 * epoch) ^ file_id) % self.streams
        return (record + rot) % self.streams == self.stream


def stream_records(source: Source, sel: Selection, start: RecordPos) -> Iterator[tuple[RecordPos, Any]]:
    """The records of `sel`'s stream from `start` on, epoch after epoch, forever; a DataError when a whole
    epoch holds none of them (fewer records than streams)."""
    epoch, fpos, rec, byte = start.epoch, start.file, start.record, start.byte
    while True:
        order = source.file_order(epoch)
        found = fpos > 0 or rec > 0  # resumed mid-epoch: this epoch had records before
        for fi in range(fpos, len(order)):
            file_id = int(order[fi])
            first = fi == fpos
            for index, offset, raw in source.records(file_id, rec if first else 0, byte if first else 0):
                if sel.mine(file_id, index, epoch):
                    found = True
                    yield RecordPos(epoch, fi, index, offset), raw
        if not found:
            split = "validation" if sel.valid else "training"
            raise DataError(f"{source.path!r}: stream {sel.stream} of {sel.streams} got no {split} record in a whole "
                            "epoch: the data has too few records for data.streams (lower it) or, for validation, "
                            "for data.valid_fraction")
        epoch, fpos, rec, byte = epoch + 1, 0, 0, 0
