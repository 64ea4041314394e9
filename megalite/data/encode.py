"""Records to tokens, in tokenizer worker processes: decode, parse, check, tokenize (text or chat).

A record is a JSON line's raw bytes or a table row's value. Each becomes either `Encoded(tokens, targets)`
or the name of what is wrong with it (`BAD_KINDS`), which the stream counts and reports (never a silent
drop):

    invalid_json   the line is not a JSON object
    missing_key    no `data.text_key` / `data.messages_key`, or not a string / a list there
    non_utf8       the line's bytes are not UTF-8
    empty          an empty text or an empty messages list
    oversized      the record is larger than `data.max_record_bytes`
    bad_chat       messages that are not {role, content} objects, or that the chat template fails on
    no_assistant   a conversation with no assistant token to learn (no assistant turn, or only empty ones)

Text records are framed as in preprocessing (`document_ids`: [BOS] + ids + [EOD]) and every token is a target.
Chat records are the template's tokens + [EOD]; the targets are the template's assistant tokens
(megalite/data/chat_template.py), the EOD is not one.

`EncoderPool` runs the encoding in `data.workers` processes (0: in the caller's thread), in order: the
stream gets the results in record order whatever the number of workers, so the tokens do not depend on it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megalite.data.documents import without_lone_surrogates
from megalite.data.sources import MISSING

BAD_KINDS = ("invalid_json", "missing_key", "non_utf8", "empty", "oversized", "bad_chat", "no_assistant")


@dataclass(frozen=True)
class EncodeOptions:
    """What a worker needs to turn records into tokens (picklable: sent to each worker once)."""

    tokenizer: str
    format: str            # "text" | "chat"
    key: str               # the JSON key / column read
    chat_template: str     # a template file, or "" for the tokenizer's own
    max_record_bytes: int


@dataclass
class Encoded:
    tokens: np.ndarray          # int32 [n]
    targets: np.ndarray | None  # bool [n]: the tokens the loss is on (None: all of them)


Result = Encoded | str


class RecordEncoder:
    """The per-process encoder: the tokenizer (and chat template) loaded once."""

    def __init__(self, opts: EncodeOptions) -> None:
        from megalite.data.tokenizer import load_tokenizer

        self.opts = opts
        self.tok = load_tokenizer(opts.tokenizer)
        self.chat: Any = None
        if opts.format == "chat":
            from megalite.data.chat_template import build_chat

            self.chat = build_chat(self.tok, opts.chat_template, opts.max_record_bytes)

    def __call__(self, raw: Any) -> Result:
        value = self._value(raw)
        if isinstance(value, _Bad):
            return value.kind
        if self.chat is None:
            from megalite.data.tokenizer import document_ids

            if not isinstance(value, str):
                return "missing_key"
            if not value:
                return "empty"
            return Encoded(np.asarray(document_ids(self.tok, without_lone_surrogates(value)), dtype=np.int32), None)
        return self._chat(value)

    def _value(self, raw: Any) -> Any:
        limit = self.opts.max_record_bytes
        if raw is MISSING:
            return _Bad("missing_key")
        if not isinstance(raw, (bytes, bytearray)):
            if isinstance(raw, str) and limit > 0 and len(raw) > limit // 4 and len(raw.encode("utf-8")) > limit:
                return _Bad("oversized")
            return raw
        if limit > 0 and len(raw) > limit:
            return _Bad("oversized")
        try:
            line = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return _Bad("non_utf8")
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            return _Bad("invalid_json")
        if not isinstance(obj, dict):
            return _Bad("invalid_json")
        if self.opts.key not in obj:
            return _Bad("missing_key")
        return obj[self.opts.key]

    def _chat(self, messages: Any) -> Result:
        from megalite.data.chat_template import encode_chat

        if not isinstance(messages, list):
            return "missing_key"
        if not messages:
            return "empty"
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return "bad_chat"
        template, encoder = self.chat
        try:
            ids, mask = encode_chat(template, encoder, messages)
        except ValueError:
            return "bad_chat"
        if not any(mask):  # nothing to learn: packed, it would be a sample at loss 0 (or a step of nothing)
            return "no_assistant"
        tokens = np.asarray(ids + [self.tok.eod_id], dtype=np.int32)
        targets = np.asarray(mask + [0], dtype=bool)
        return Encoded(tokens, targets)


@dataclass(frozen=True)
class _Bad:
    kind: str


_WORKER: dict[str, RecordEncoder] = {}  # this worker process's encoder (set by `_init_worker`)


def _init_worker(opts: EncodeOptions) -> None:
    _WORKER["encoder"] = RecordEncoder(opts)


def _encode_batch(raws: list[Any]) -> list[Result]:
    encoder = _WORKER["encoder"]
    return [encoder(r) for r in raws]


class EncoderPool:
    """`workers` tokenizer processes shared by every stream of this rank (0: encode in the calling thread)."""

    def __init__(self, opts: EncodeOptions, workers: int) -> None:
        self.opts, self.workers = opts, workers
        self.local = RecordEncoder(opts)  # also checks the tokenizer and template here, before any worker starts
        self._pool: Any = None
        if workers > 0:
            ctx = mp.get_context("forkserver")
            self._pool = ctx.Pool(workers, initializer=_init_worker, initargs=(opts,))

    def submit(self, raws: list[Any]) -> Any:
        """A handle whose `get()` is the batch's results, in order."""
        if self._pool is None:
            return _Done([self.local(r) for r in raws])
        return self._pool.apply_async(_encode_batch, (raws,))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


@dataclass
class _Done:
    value: list[Result]

    def get(self) -> list[Result]:
        return self.value


class Cancelled(Exception):
    """The reader was told to stop (the loader is closing): raised between two records or while waiting for the
    workers."""


def _results(handle: Any, cancel: threading.Event | None) -> list[Result]:
    """A batch's results; a closing loader does not wait for them (a worker may be busy with a slow record)."""
    if cancel is None or isinstance(handle, _Done):
        return handle.get()  # type: ignore[no-any-return]
    while True:
        try:
            return handle.get(timeout=0.1)  # type: ignore[no-any-return]
        except mp.TimeoutError:
            if cancel.is_set():
                raise Cancelled() from None


def encoded(records: Iterator[tuple[Any, Any]], pool: EncoderPool, batch: int = 64,
            depth: int = 4, cancel: threading.Event | None = None) -> Iterator[tuple[Any, Result]]:
    """(position, result) for each (position, raw) of `records`, in order, with up to `depth` batches of
    `batch` records in the workers ahead of the one being read."""
    pending: deque[tuple[list[Any], Any]] = deque()
    done = False
    while True:
        while not done and len(pending) < max(1, depth if pool.workers else 1):
            chunk = []
            for item in records:
                chunk.append(item)
                if len(chunk) == batch:
                    break
            if len(chunk) < batch:
                done = True
            if chunk:
                pending.append(([p for p, _ in chunk], pool.submit([r for _, r in chunk])))
        if not pending:
            return
        positions, handle = pending.popleft()
        yield from zip(positions, _results(handle, cancel))
