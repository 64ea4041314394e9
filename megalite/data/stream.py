"""One data stream: a deterministic sequence of training samples, blended over the `data.path` sources.

A run's data is `data.streams` = V streams, a number that does not depend on the layout. Each stream blends
its sources with `data.weights` by Megatron's greedy rule (sample n comes from the source whose count lags
`weight * (n + 1)` the most), and each source feeds it a sub-stream of its own:

  * a raw source (`RecordStream`): the records `Selection` gives this stream, encoded by the tokenizer
    workers and packed (megalite/data/packing.py); its state is the packer's cursor;
  * a `.bin`/`.idx` source (`IndexedStream`): sample n of stream v is the GPTDataset sample at position
    n * V + v of the seeded epoch order the DataSampler uses; its state is n.

A stream's state is a small JSON object, so the V states together are the run's data position in a form
that no layout enters (megalite/data/position.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np

from megalite.data.encode import EncoderPool, encoded
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.packing import Counts, Cursor, Packer
from megalite.data.sampler import DataSampler
from megalite.data.sources import START, Selection, Source, stream_records

Sample = tuple[np.ndarray, np.ndarray]  # tokens int64 [S + 1], targets bool [S]


class SubStream(Protocol):
    def next_sample(self) -> Sample: ...

    def state(self) -> dict[str, Any]: ...

    def counts(self) -> Counts: ...

    def tokens_in(self) -> int: ...


class RecordStream:
    """A raw source's records for one stream, encoded and packed."""

    def __init__(self, source: Source, sel: Selection, seq_len: int, pool: EncoderPool,
                 state: dict[str, Any] | None) -> None:
        start = Cursor.of(state["cursor"]) if state else Cursor(START, 0, Counts())
        self.packer = Packer(encoded(stream_records(source, sel, start.pos), pool), seq_len, start)

    def next_sample(self) -> Sample:
        return self.packer.next_sample()

    def state(self) -> dict[str, Any]:
        return {"cursor": self.packer.cursor().to_dict()}

    def counts(self) -> Counts:
        # What the packer has read, the record it is cutting sequences from included. The cursor's counts
        # (saved for the exact resume) stop before that record: a corpus of documents longer than a step's
        # tokens read as "0 records read" after step 1.
        return self.packer.counts.copy()

    def tokens_in(self) -> int:
        return self.packer.tokens_in


class IndexedStream:
    """A `.bin`/`.idx` dataset's samples for stream `stream` of `streams`."""

    def __init__(self, dataset: GPTDataset, stream: int, streams: int, seed: int,
                 state: dict[str, Any] | None) -> None:
        self.dataset, self.stream, self.streams = dataset, stream, streams
        self.order = DataSampler(len(dataset), 1, 1, 0, 1, seed)
        self.n = int(state["n"]) if state else 0
        self._tokens = 0

    def next_sample(self) -> Sample:
        i = int(self.order.indices_at(np.asarray([self.n * self.streams + self.stream], dtype=np.int64))[0])
        self.n += 1
        tokens = self.dataset[i]
        self._tokens += len(tokens) - 1
        return tokens, np.ones(len(tokens) - 1, dtype=bool)

    def state(self) -> dict[str, Any]:
        return {"n": self.n}

    def counts(self) -> Counts:
        return Counts()

    def tokens_in(self) -> int:
        return self._tokens


SourceSpec = Union[Source, GPTDataset]


@dataclass(frozen=True)
class StreamSpec:
    """What every stream of a run shares: the sources (one split of them), weights and sample shape."""

    sources: list[SourceSpec]
    weights: list[float]
    seq_len: int
    seed: int
    streams: int
    valid: bool
    valid_fraction: float


class Stream:
    """Stream `index` of `spec.streams`: the greedy blend of one sub-stream per source."""

    def __init__(self, spec: StreamSpec, index: int, pool: EncoderPool, state: dict[str, Any] | None) -> None:
        self.spec, self.index = spec, index
        self.taken = [int(t) for t in state["taken"]] if state else [0] * len(spec.sources)
        subs = state["subs"] if state else [None] * len(spec.sources)
        self.subs: list[SubStream] = []
        for src, sub in zip(spec.sources, subs):
            if isinstance(src, Source):
                sel = Selection(index, spec.streams, spec.valid, spec.valid_fraction, spec.seed)
                self.subs.append(RecordStream(src, sel, spec.seq_len, pool, sub))
            else:
                self.subs.append(IndexedStream(src, index, spec.streams, spec.seed, sub))
        total = sum(spec.weights)
        self.weights = [w / total for w in spec.weights]

    def next_sample(self) -> Sample:
        n = sum(self.taken) + 1
        best = max(range(len(self.subs)), key=lambda i: (self.weights[i] * n - self.taken[i], -i))
        self.taken[best] += 1
        return self.subs[best].next_sample()

    def state(self) -> dict[str, Any]:
        return {"taken": list(self.taken), "subs": [s.state() for s in self.subs]}

    def counts(self) -> Counts:
        total = Counts()
        for s in self.subs:
            total.add(s.counts())
        return total

    def tokens_in(self) -> int:
        return sum(s.tokens_in() for s in self.subs)
