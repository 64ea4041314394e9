"""The streamed data for one rank: its streams, read ahead in a background thread, as micro-batches per step.

`StreamLoader` is what the trainer asks for each step's batches when `data.path` holds a raw source (jsonl,
parquet, a datasets directory; megalite/data/sources.py). This rank's data-parallel block of the V streams
(megalite/data/position.py) is produced by a thread that stays up to `data.prefetch` steps ahead, the
tokenization itself in `data.workers` processes (megalite/data/encode.py), so a step waits for data only when
the loader is slower than training; `report()` says how long it waited and how fast the loader runs.

Labels carry the loss mask: a label the loss is not on (SFT: not an assistant token) is -100, the cross
entropy's ignore index, so the mask travels wherever labels travel (to the last pipeline stage, through the
context-parallel split), with no second tensor.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from megalite.data.encode import BAD_KINDS, Cancelled, EncodeOptions, EncoderPool
from megalite.data.gpt_dataset import GPTDataset, split_documents
from megalite.data.indexed import IndexedDataset
from megalite.data.packing import Counts, ReadLimits
from megalite.data.position import check_resume, check_streams, owned_streams, position, token_file_fingerprint
from megalite.data.sampler import cp_split
from megalite.data.sources import Source, is_streaming
from megalite.data.stream import SourceSpec, Stream, StreamSpec
from megalite.data.tokenizer import Tokenizer
from megalite.errors import ConfigError, DataError

if TYPE_CHECKING:
    from megalite.config.schema import Config

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE = -100  # the cross entropy's ignore_index


@dataclass(frozen=True)
class RankSlice:
    """Which part of the data this rank reads: its dp block of streams, its cp split of each sample."""

    dp: int
    dp_rank: int
    cp: int = 1
    cp_rank: int = 0


def to_batch(samples: list[tuple[np.ndarray, np.ndarray]], cp: int, cp_rank: int) -> Batch:
    """(input_ids [B, S], labels [B, S]) from samples of S + 1 tokens; labels off the targets are -100."""
    tokens = torch.from_numpy(np.stack([s for s, _ in samples]))
    targets = torch.from_numpy(np.stack([t for _, t in samples]))
    labels = torch.where(targets, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE))
    return cp_split(tokens[:, :-1], cp, cp_rank), cp_split(labels, cp, cp_rank)


@dataclass
class _Step:
    batches: list[Batch]
    states: dict[int, dict[str, Any]]
    counts: Counts
    tokens: int


class StreamLoader:
    """This rank's streams of the run's raw (and `.bin`/`.idx`) sources."""

    def __init__(self, cfg: Config, ranks: RankSlice, tokenizer: Tokenizer) -> None:
        data, tr = cfg.data, cfg.train
        self.cfg, self.ranks, self.tokenizer = cfg, ranks, tokenizer
        self.seq_len, self.seed = int(cfg.model.seq_len), int(tr.seed)
        self.global_batch, self.micro = int(tr.global_batch_size), int(tr.micro_batch_size)
        if data.format not in ("text", "chat"):
            raise ConfigError(f"data.format = {data.format!r}: choose text or chat")
        paths = list(data.path)
        if len(paths) > 1 and len(data.weights) != len(paths):
            raise ConfigError(f"data.path mixes {len(paths)} sources with a raw (streamed) one: give data.weights, "
                              "one per path (a raw source's size in tokens is not known before it is read)")
        self.weights = list(data.weights) or [1.0]
        train: list[SourceSpec] = []
        valid: list[SourceSpec] = []
        self.fingerprints: list[dict[str, Any]] = []
        key = data.messages_key if data.format == "chat" else data.text_key
        for p in paths:
            if is_streaming(p):
                src = Source.open(p, key, self.seed, max(0, int(data.max_record_bytes)))
                train.append(src)
                valid.append(src)
                self.fingerprints.append(src.fingerprint())
            else:
                ix = IndexedDataset(p, vocab_size=tokenizer.vocab_size)
                if data.document_mask:  # a raw source always has them: megalite/data/encode.py appends the EOD
                    ix.check_document_ends(tokenizer.eod_id)
                t_docs, v_docs = split_documents(len(ix), float(data.valid_fraction), self.seed)
                train.append(GPTDataset(ix, t_docs, self.seq_len, self.seed, name="train"))
                if len(v_docs):
                    valid.append(GPTDataset(ix, v_docs, self.seq_len, self.seed, name="validation"))
                self.fingerprints.append({**token_file_fingerprint(p), "documents": len(ix), "tokens": ix.num_tokens})
        self.has_valid = float(data.valid_fraction) > 0 and len(valid) == len(train)
        self._train, self._valid = train, valid
        self.streams = int(data.streams) or ranks.dp
        check_streams(self.streams, ranks.dp, self.global_batch)
        opts = EncodeOptions(tokenizer.path, data.format, key, data.chat_template, int(data.max_record_bytes))
        self.pool = EncoderPool(opts, int(data.workers))
        self._states: dict[int, dict[str, Any]] = {}
        self.steps = 0
        self._consumed: _Step | None = None
        self._previous: _Step | None = None
        self._queue: queue.Queue[_Step | BaseException] = queue.Queue(maxsize=max(1, int(data.prefetch)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy_s = 0.0
        self._produced_tokens = 0
        self.wait_s = 0.0          # the last step's wait for data
        self.total_wait_s = 0.0
        self._valid_batches: list[Batch] | None = None
        # Validation is built first, by the loader thread, when the run evaluates: a split too small for it is
        # refused before step 1, not at the first evaluation.
        self._valid_first = self.has_valid and int(tr.eval_interval) > 0
        self._valid_ready = threading.Event()
        self.skipped = [s.skipped for s in train if isinstance(s, Source) and s.skipped]

    def _limits(self) -> ReadLimits:
        return ReadLimits(int(self.cfg.data.max_bad_records), float(self.cfg.data.max_bad_fraction), self._stop)

    def _spec(self, valid: bool) -> StreamSpec:
        return StreamSpec(self._valid if valid else self._train, self.weights, self.seq_len, self.seed,
                          self.streams, valid, float(self.cfg.data.valid_fraction))

    def owned(self) -> range:
        return owned_streams(self.streams, self.ranks.dp, self.ranks.dp_rank)

    # -- the data position ------------------------------------------------------------------------------------
    def load_position(self, saved: dict[str, Any]) -> str | None:
        """Resume at a checkpoint's position (before the first `next_step`). When the data changed since, a
        DataError, or with `data.on_change restart` the data read from its start and a note saying so."""
        if self._thread is not None:
            raise RuntimeError("load_position after the loader started")
        streams, why = check_resume(saved, self.seq_len, self.seed, self.fingerprints,
                                    restart=self.cfg.data.on_change == "restart")
        if streams is None:
            return f"data: {why}; data.on_change restart: reading the data from its start"
        self.streams = streams
        check_streams(self.streams, self.ranks.dp, self.global_batch)
        self._states = {v: saved["states"][v] for v in self.owned()}
        self.steps = int(saved["steps"])
        return None

    def local_states(self) -> dict[int, dict[str, Any]]:
        """This rank's streams' states after the last step it consumed."""
        return dict(self._consumed.states) if self._consumed is not None else dict(self._states)

    def position(self, gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
        """The run's data position (every stream), from each dp rank's `local_states` (`gather` over dp)."""
        merged: dict[int, dict[str, Any]] = {}
        for part in gather(self.local_states()):
            merged.update({int(k): v for k, v in part.items()})
        states = [merged.get(v) or self._fresh_state(v) for v in range(self.streams)]
        return position(self.streams, self.seq_len, self.seed, self.fingerprints, states, self.steps)

    def _fresh_state(self, v: int) -> dict[str, Any]:
        raise DataError(f"stream {v} has no state to save: a data-parallel rank did not report it")

    # -- batches ----------------------------------------------------------------------------------------------
    def _make_step(self, streams: list[Stream]) -> _Step:
        per = self.global_batch // self.streams
        samples = []
        for s in streams:
            for _ in range(per):
                if self._stop.is_set():  # closing: a slow source must not hold the run's exit
                    raise Cancelled()
                samples.append(s.next_sample())
        batches = [to_batch(samples[i: i + self.micro], self.ranks.cp, self.ranks.cp_rank)
                   for i in range(0, len(samples), self.micro)]
        counts = Counts()
        for s in streams:
            counts.add(s.counts())
        return _Step(batches, {v: s.state() for v, s in zip(self.owned(), streams)}, counts,
                     len(samples) * self.seq_len)

    def _produce(self) -> None:
        try:
            if self._valid_first:
                self._build_validation()
            limits = self._limits()
            streams = [Stream(self._spec(False), v, self.pool, self._states.get(v), limits) for v in self.owned()]
            first = True
            while not self._stop.is_set():
                t0 = time.perf_counter()
                step = self._make_step(streams)
                if not first:  # the first step also waits for the workers to start: not the loader's speed
                    self._busy_s += time.perf_counter() - t0
                    self._produced_tokens += step.tokens
                first = False
                while not self._stop.is_set():
                    try:
                        self._queue.put(step, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except Cancelled:
            pass
        except BaseException as e:  # handed to the training thread, which raises it at its next step
            self._queue.put(e)
        finally:
            self._valid_ready.set()  # a validation() waiting on a loader that failed first gets the error

    def _build_validation(self) -> None:
        streams = [Stream(self._spec(True), v, self.pool, None, self._limits()) for v in self.owned()]
        steps = int(self.cfg.train.eval_steps)
        self._valid_batches = [b for _ in range(steps) for b in self._make_step(streams).batches]
        self._valid_ready.set()

    def next_step(self, stop: Callable[[], bool] | None = None) -> list[Batch] | None:
        """This rank's micro-batches of the next step; None when `stop()` turned true while waiting for them (a
        stop signal: the wait for a slow or failing source never outlasts it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="megalite-data", daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if stop is not None and stop():
                    return None
        self.wait_s = time.perf_counter() - t0
        self.total_wait_s += self.wait_s
        if isinstance(item, BaseException):
            if isinstance(item, (DataError, ConfigError)):
                raise item
            raise DataError(f"the data loader failed: {type(item).__name__}: {item}") from item
        self._previous, self._consumed = self._consumed, item
        self.steps += 1
        return item.batches

    def untake(self) -> None:
        """The last step's batches were not trained on (the run stopped before the step): the position goes
        back to before them, so a resumed run reads them."""
        self._consumed = self._previous
        self.steps -= 1

    def counts(self) -> Counts:
        """Records read and bad records of this rank's streams, up to the last consumed step."""
        return self._consumed.counts if self._consumed is not None else Counts()

    def report(self) -> dict[str, Any]:
        """The loader's numbers for metrics.jsonl: this rank's wait for data and the loader's own speed."""
        rate = self._produced_tokens / self._busy_s if self._busy_s > 0 else None
        return {"wait_s": self.wait_s, "total_wait_s": self.total_wait_s, "loader_tokens_per_s": rate,
                "ahead": self._queue.qsize()}

    def validation(self, eval_steps: int) -> list[Batch] | None:
        """The same `eval_steps` steps of held-out samples every time (built once: by the loader thread before
        step 1's data when the run evaluates, else at the first call, in this thread)."""
        if not self.has_valid:
            return None
        if self._valid_first and self._thread is not None:  # the loader thread built it before step 1's data
            self._valid_ready.wait()
        if self._valid_batches is None:
            streams = [Stream(self._spec(True), v, self.pool, None, self._limits()) for v in self.owned()]
            self._valid_batches = [b for _ in range(eval_steps) for b in self._make_step(streams).batches]
        return self._valid_batches

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()  # unblock a put
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.1)
        self.pool.close()


COUNT_FIELDS = ("records",) + BAD_KINDS


def counts_vector(counts: Counts) -> list[int]:
    return [counts.records] + [counts.bad.get(k, 0) for k in BAD_KINDS]


def counts_of(vector: list[int]) -> Counts:
    return Counts(int(vector[0]), {k: int(v) for k, v in zip(BAD_KINDS, vector[1:])})
