"""The `.bin` + `.idx` token dataset format (in the spirit of Megatron-LM's MMapIndexedDataset).

`PREFIX.bin` holds the token ids of all documents back to back, nothing else: little-endian `uint16`
when every id fits (vocabulary of at most 65,536 ids: half the disk and page cache of 32 bits), else
`uint32` (Llama 3's 128,256, o200k's 200,019 ids). Files written with `int32` (dtype code 2, what
megalite wrote for large vocabularies before uint32) still load.

`PREFIX.idx` is a 48-byte header followed by `num_docs + 1` little-endian int64 document offsets, in
tokens (document i is `bin[offsets[i]:offsets[i+1]]`, `offsets[0] == 0`, `offsets[-1] == num_tokens`):

    offset size  field
    0      8     magic          b"MGLTIDX\\0"
    8      4     version        uint32, currently 1
    12     4     dtype code     uint32: 1 = uint16, 2 = int32 (read only), 3 = uint32
    16     8     num_docs       uint64
    24     8     num_tokens     uint64 (so a .bin/.idx pair from different runs is caught by size)
    32     8     vocab_size     uint64, of the tokenizer that wrote it (0 = unknown)
    40     8     max_token_id   int64, the largest id in the .bin (checked against a tokenizer in O(1))
    48     8*(num_docs+1)       offsets

Both files are read with `np.memmap`, so opening a terabyte dataset costs nothing and reads are served
by the page cache. The writer writes both files under temporary names and renames them at the end, so a
crash never leaves a half-written pair under the final names.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from megalite.atomic import open_no_link, refuse_link
from megalite.errors import DataError

MAGIC = b"MGLTIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQq")
HEADER_SIZE = _HEADER.size  # 48: a multiple of 8, so the int64 offsets are aligned for np.memmap
_DTYPES: dict[int, type[np.integer[Any]]] = {1: np.uint16, 2: np.int32, 3: np.uint32}
_FIX = "re-run tools/preprocess_data.py to rebuild it"


def dtype_for_vocab(vocab_size: int) -> type[np.integer[Any]]:
    """uint16 while every id (< vocab_size) fits in it, else uint32."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _dtype_code(dtype: type[np.integer[Any]]) -> int:
    return next(code for code, dt in _DTYPES.items() if dt is dtype)


def strip_suffix(prefix: str) -> str:
    """Accept `data.bin` / `data.idx` where a prefix `data` is meant."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


class IndexedDatasetWriter:
    """Append documents of token ids; `finalize()` publishes `prefix.bin` and `prefix.idx` atomically."""

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = strip_suffix(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self._disk_dtype = np.dtype(self.dtype).newbyteorder("<")
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._tmp_bin = f"{self.prefix}.bin.tmp-{os.getpid()}"
        self._tmp_idx = f"{self.prefix}.idx.tmp-{os.getpid()}"
        for final in (self.prefix + ".bin", self.prefix + ".idx"):
            refuse_link(final, DataError, hard_links=False)  # renamed over at the end: never a link's target
        self._bin = open_no_link(self._tmp_bin, "wb", DataError)
        self._lengths: list[int] = []
        self._max_id = -1
        self._done = False

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ids, EOD included if wanted: the writer adds nothing)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of ids, got shape {arr.shape}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise DataError(f"document {len(self._lengths)} has token id {bad} outside [0, {self.vocab_size}):"
                                " the ids do not come from a tokenizer with this vocab_size")
            self._max_id = max(self._max_id, hi)
        self._bin.write(arr.astype(self._disk_dtype).tobytes())
        self._lengths.append(int(arr.size))

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    def finalize(self) -> str:
        """Write the index and rename both files into place (each fsynced first); returns the prefix."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        if not self._lengths:
            self.abort()
            raise DataError(f"no documents to write to {self.prefix!r}: the inputs held no text")
        offsets = np.zeros(len(self._lengths) + 1, dtype="<i8")
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        header = _HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(self._lengths), int(offsets[-1]),
                              self.vocab_size, self._max_id)
        with open_no_link(self._tmp_idx, "wb", DataError) as f:
            f.write(header)
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        # .bin first: a reader that finds the new .idx also finds the .bin it describes.
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")
        self._done = True
        return self.prefix

    def abort(self) -> None:
        """Drop the temporary files (called on an exception inside a `with` block). Closing may fail again
        (a full disk refuses the buffered bytes once more): the files are removed all the same."""
        self._done = True
        try:
            self._bin.close()
        except OSError:
            pass  # the removal below is what matters; the caller's exception is the one reported
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.lexists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not self._done:
            self.abort()


_SCAN_CHUNK = 1 << 25  # tokens per read while scanning: 64-128 MiB, streamed through the page cache
# The whole-file id scan at open stops paying beyond a few seconds of reading per rank per start; larger
# files are checked sample by sample as they are read (`IndexedDataset.check_sample_ids`).
SCAN_AT_OPEN_MAX_BYTES = 4 << 30


def check_token_range(tokens: np.ndarray, header_max: int, bin_path: str) -> None:
    """Scan the whole `.bin` once for ids outside [0, header max]: the header's max_token_id is what the
    tokenizer check trusts, so a hand-edited or foreign header would otherwise surface as an IndexError in
    the embedding mid-training. Costs one sequential read (about a second per few GB; a progress bar
    shows for large files); SIGTERM/SIGUSR1 keep their default meaning meanwhile, since nothing has
    started that would need saving. Run at open for files up to `SCAN_AT_OPEN_MAX_BYTES`; beyond, every
    rank re-reading terabytes at every start would cost more than it saves, and `check_sample_ids` checks
    each sample as it is read instead."""
    from megalite.observability.progress import Progress

    n = len(tokens)
    with Progress(-(-n // _SCAN_CHUNK), f"checking token ids of {bin_path}", "chunks",
                  enabled=n > 8 * _SCAN_CHUNK) as bar:
        for start in range(0, n, _SCAN_CHUNK):
            chunk = tokens[start:start + _SCAN_CHUNK]
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi > header_max:
                bad = lo if lo < 0 else hi
                raise DataError(f"{bin_path!r} holds token id {bad} (near token {start}), outside the range "
                                f"0..{header_max} its .idx header promises: the pair is corrupt or mismatched; "
                                f"{_FIX}")
            bar.update()


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin`/`.idx` pair; item i is document i's token ids.

    `vocab_size`: when given, a dataset holding an id >= vocab_size is rejected (wrong tokenizer).
    """

    def __init__(self, prefix: str, vocab_size: int | None = None,
                 scan_at_open_max_bytes: int = SCAN_AT_OPEN_MAX_BYTES) -> None:
        self.prefix = strip_suffix(prefix)
        self._check_vocab = vocab_size
        self._scan_limit = scan_at_open_max_bytes
        self._scanned = False
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"dataset file not found: {path!r}; build the .bin/.idx pair with "
                                f"`python tools/preprocess_data.py --input ... --output-prefix {self.prefix}`")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise DataError(f"{idx_path!r} is truncated ({idx_size} bytes, the header alone is {HEADER_SIZE}): "
                            + _FIX)
        with open(idx_path, "rb") as f:
            magic, version, code, num_docs, num_tokens, vocab, max_id = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise DataError(f"{idx_path!r} is not a megalite index (bad magic {magic!r}): {_FIX}")
        if version != VERSION:
            raise DataError(f"{idx_path!r} has format version {version}, this megalite reads {VERSION}: {_FIX}")
        if code not in _DTYPES:
            raise DataError(f"{idx_path!r} has unknown dtype code {code}: {_FIX}")
        expected = HEADER_SIZE + 8 * (num_docs + 1)
        if idx_size != expected:
            what = "truncated" if idx_size < expected else "too long"
            raise DataError(f"{idx_path!r} is {what}: {idx_size} bytes, but its header promises {num_docs} "
                            f"documents ({expected} bytes): {_FIX}")
        if num_docs == 0 or num_tokens == 0:
            raise DataError(f"dataset {self.prefix!r} is empty ({num_docs} documents, {num_tokens} tokens): "
                            "preprocess some text into it")
        self.dtype = _DTYPES[code]
        itemsize = np.dtype(self.dtype).itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != num_tokens * itemsize:
            raise DataError(f"{bin_path!r} holds {bin_size // itemsize} tokens but {idx_path!r} says {num_tokens}: "
                            f"the pair is mismatched (from different runs) or truncated: {_FIX}")
        offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER_SIZE, shape=(num_docs + 1,))
        if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) < 0):
            raise DataError(f"{idx_path!r} has inconsistent document offsets (corrupt file): {_FIX}")
        self.offsets: np.ndarray = offsets
        self.tokens: np.ndarray = np.memmap(bin_path, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r",
                                            shape=(num_tokens,))
        self.vocab_size: int = int(vocab)
        self.max_token_id: int = int(max_id)
        self.num_tokens: int = int(num_tokens)
        self.doc_lengths: np.ndarray = np.diff(offsets).astype(np.int64)
        if self._check_vocab is not None and self.max_token_id >= self._check_vocab:
            raise DataError(f"dataset {self.prefix!r} holds token id {self.max_token_id} but the tokenizer has only "
                            f"{self._check_vocab} ids: it was made with another tokenizer; pass the one used "
                            "for preprocessing (data.tokenizer) or re-run preprocessing")
        if self._check_vocab is not None and not self._scanned and bin_size <= self._scan_limit:
            check_token_range(self.tokens, self.max_token_id, bin_path)
            self._scanned = True  # a copy re-opened in another process (pickling) trusts this scan

    def check_sample_ids(self, sample: np.ndarray) -> None:
        """A DataError when `sample` (ids read from this dataset) holds an id above the header's max: the
        per-read guard for files too large to scan at open (a max over one sample, microseconds)."""
        if self._check_vocab is None or self._scanned or sample.size == 0:
            return
        lo, hi = int(sample.min()), int(sample.max())
        if lo < 0 or hi > self.max_token_id:
            bad = lo if lo < 0 else hi
            raise DataError(f"{self.prefix + '.bin'!r} holds token id {bad}, outside the range "
                            f"0..{self.max_token_id} its .idx header promises: the pair is corrupt or mismatched; "
                            f"{_FIX}")

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def check_document_ends(self, eod_id: int, sample: int = 256) -> None:
        """data.document_mask splits packed samples at `eod_id`: refuse data whose documents do not end with it
        (prepared without EOD tokens, or with another tokenizer), where the mask would silently mask nothing.

        Up to `sample` documents spread over the dataset are looked at (one token each): cheap at any size.
        Refusing, not warning: a run that asked for document masking and got none has trained another model."""
        n = len(self)
        picks = np.unique(np.linspace(0, max(n - 1, 0), min(n, sample)).astype(np.int64))
        ends = [int(self.tokens[int(self.offsets[i + 1]) - 1]) for i in picks if self.offsets[i + 1] > self.offsets[i]]
        if ends and eod_id not in ends:
            raise DataError(f"data.document_mask is set but none of {len(ends)} documents of {self.prefix!r} ends "
                            f"with the tokenizer's end-of-document id {eod_id}, so nothing would be masked: "
                            "preprocess the data again with this tokenizer (tools/preprocess_data.py appends it), "
                            "or set data.document_mask=false")

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset+length` of document i (to its end when length is None); a memmap view."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if not 0 <= offset <= end - start:
            raise IndexError(f"offset {offset} out of range for document {i} of {end - start} tokens")
        stop = end if length is None else min(end, start + offset + length)
        return self.tokens[start + offset: stop]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    # np.memmap pickles as a full in-memory copy: send the prefix and re-open in the other process instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "vocab_size": self._check_vocab, "scanned": self._scanned,
                "scan_limit": self._scan_limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix, self._check_vocab = state["prefix"], state["vocab_size"]
        self._scanned = state.get("scanned", False)
        self._scan_limit = state.get("scan_limit", SCAN_AT_OPEN_MAX_BYTES)
        self._open()

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype.__name__})")
