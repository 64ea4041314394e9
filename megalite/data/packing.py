"""Packing encoded records into training sequences, with a position that says exactly where the next one starts.

Records' tokens (each ending in EOD) are concatenated and cut into samples of `seq_len + 1` tokens, sample k
starting `seq_len` tokens after sample k-1, as GPTDataset cuts the `.bin` stream: consecutive samples share
one token, so every token is predicted once and no token is padding. A sample's `targets` say, per label
(tokens 1..seq_len), whether the loss is on it (SFT: the assistant's tokens; text: all).

The packer's position is the record the next sample starts in and the token offset inside it (`Cursor`),
plus the bad-record counts *before* that record: restarting the record stream at that record and dropping
`offset` tokens gives the same samples again, and counting from those counts counts each bad record once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megalite.data.encode import BAD_KINDS, Cancelled, Encoded, Result
from megalite.data.sources import START, RecordPos
from megalite.errors import DataError


@dataclass
class Counts:
    """Records read and bad records by kind (`encode.BAD_KINDS`) of one stream."""

    records: int = 0
    bad: dict[str, int] = field(default_factory=lambda: {k: 0 for k in BAD_KINDS})

    def copy(self) -> Counts:
        return Counts(self.records, dict(self.bad))

    def add(self, other: Counts) -> None:
        self.records += other.records
        for k, v in other.bad.items():
            self.bad[k] = self.bad.get(k, 0) + v

    def to_dict(self) -> dict[str, Any]:
        return {"records": self.records, "bad": dict(self.bad)}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Counts:
        bad = {k: 0 for k in BAD_KINDS}
        bad.update({str(k): int(v) for k, v in d.get("bad", {}).items()})
        return cls(int(d.get("records", 0)), bad)


def bad_summary(counts: Counts) -> str:
    bad = {k: v for k, v in counts.bad.items() if v}
    if not bad:
        return "no bad records"
    return f"{sum(bad.values())} bad (" + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) + ")"


def check_bad_records(counts: Counts, max_records: int, max_fraction: float) -> None:
    """A DataError when `counts` pass `data.max_bad_records` or, from the 1,000th record on, the share
    `data.max_bad_fraction`."""
    bad = sum(counts.bad.values())
    over_count = max_records >= 0 and bad > max_records
    over_share = counts.records >= 1000 and bad > max_fraction * counts.records
    if over_count or over_share:
        limit = (f"data.max_bad_records = {max_records}" if over_count
                 else f"data.max_bad_fraction = {max_fraction} of {counts.records} records")
        raise DataError(f"data: {bad_summary(counts)} of {counts.records} records read, over {limit}: fix the "
                        "records (the kinds are listed in docs/data.md) or raise the limit")


class ReadLimits:
    """The bad-record limits, checked as each record is read (not after a step: a source whose every record is
    bad never completes one). One per rank and split, shared by its streams: a rank's own bad records passing
    `data.max_bad_records` means the run's do; the share is judged on the records this rank has read. `cancel`
    set stops the reading at the next record (a long stretch of bad records must not hold up a closing run)."""

    def __init__(self, max_records: int, max_fraction: float, cancel: threading.Event | None = None) -> None:
        self.max_records, self.max_fraction, self.cancel = max_records, max_fraction, cancel
        self.total = Counts()

    def start(self, counts: Counts) -> None:
        """A stream (re)starts with `counts` already read (a resume)."""
        self.total.add(counts)

    def read(self, bad: str | None) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        self.total.records += 1
        if bad is not None:
            self.total.bad[bad] = self.total.bad.get(bad, 0) + 1
            check_bad_records(self.total, self.max_records, self.max_fraction)


NO_LIMITS = ReadLimits(-1, 1.0)


@dataclass(frozen=True)
class Cursor:
    """Where a stream's next sample starts: token `offset` of the record at `pos`; `counts` before that record."""

    pos: RecordPos
    offset: int
    counts: Counts

    def to_dict(self) -> dict[str, Any]:
        return {"pos": self.pos.to_list(), "offset": self.offset, "counts": self.counts.to_dict()}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Cursor:
        return cls(RecordPos.of(d["pos"]), int(d["offset"]), Counts.of(d["counts"]))


@dataclass
class _Segment:
    pos: RecordPos
    counts: Counts      # before this record
    tokens: np.ndarray
    targets: np.ndarray


class Packer:
    """Samples of `seq_len + 1` tokens from (position, encode result) items, in order."""

    def __init__(self, items: Iterator[tuple[RecordPos, Result]], seq_len: int, start: Cursor,
                 limits: ReadLimits = NO_LIMITS, name: str = "the data") -> None:
        self.items, self.seq_len, self.limits, self.name = items, seq_len, limits, name
        self.counts = start.counts.copy()
        limits.start(self.counts)
        # The last epoch that gave a good record: a whole epoch after it without one means none will come (an
        # all-bad source would otherwise be read epoch after epoch, never making a sample). A stream resumed
        # mid-epoch has only part of its epoch left, so that epoch does not count as whole.
        whole = start.pos.file == START.file and start.pos.record == START.record and start.offset == 0
        self._good_epoch = start.pos.epoch - 1 if whole else start.pos.epoch
        self._skip = start.offset  # tokens of the first good record already used before the restart
        self._start = start
        self._buf: deque[_Segment] = deque()
        self._head = 0        # tokens of the first segment already consumed
        self._size = 0        # tokens in the buffer past the head
        self.tokens_in = 0    # tokens encoded (throughput)

    def cursor(self) -> Cursor:
        if not self._buf:
            return self._start
        first = self._buf[0]
        return Cursor(first.pos, self._head, first.counts.copy())

    def _fill(self) -> None:
        while self._size < self.seq_len + 1:
            pos, result = next(self.items)
            if not isinstance(result, Encoded):
                self.counts.records += 1
                self.counts.bad[result] = self.counts.bad.get(result, 0) + 1
                self.limits.read(result)
                if pos.epoch >= self._good_epoch + 2:
                    raise DataError(f"{self.name}: every record of a whole epoch was bad "
                                    f"({bad_summary(self.counts)} of {self.counts.records} records read): fix the "
                                    "records (the kinds are listed in docs/data.md), or check data.text_key / "
                                    "data.messages_key / data.format")
                continue
            self.limits.read(None)
            self._good_epoch = pos.epoch
            targets = result.targets if result.targets is not None else np.ones(len(result.tokens), dtype=bool)
            seg = _Segment(pos, self.counts.copy(), result.tokens, targets)
            self.counts.records += 1
            self.tokens_in += len(result.tokens)
            if self._skip:
                if self._skip >= len(seg.tokens):
                    raise ValueError(f"resume offset {self._skip} is past the end of the record at {pos} "
                                     f"({len(seg.tokens)} tokens): the data changed since the checkpoint")
                if not self._buf:
                    self._head = self._skip
                self._size -= self._skip
                self._skip = 0
            self._buf.append(seg)
            self._size += len(seg.tokens)

    def next_sample(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [seq_len + 1], targets bool [seq_len]: whether each label counts)."""
        self._fill()
        need = self.seq_len + 1
        toks, targs = [], []
        k, off = 0, self._head
        while need > 0:
            seg = self._buf[k]
            piece = min(need, len(seg.tokens) - off)
            toks.append(seg.tokens[off: off + piece])
            targs.append(seg.targets[off: off + piece])
            need -= piece
            k, off = k + 1, 0
        # Advance by seq_len: the last token is the next sample's first.
        drop = self.seq_len
        while drop > 0:
            left = len(self._buf[0].tokens) - self._head
            if drop >= left:
                drop -= left
                self._buf.popleft()
                self._head = 0
            else:
                self._head += drop
                drop = 0
        self._size -= self.seq_len
        tokens = np.concatenate(toks).astype(np.int64)
        return tokens, np.concatenate(targs)[1:]
