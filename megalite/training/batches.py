"""Where each step's micro-batches come from: the `.bin`/`.idx` sampler or the streamed raw sources.

`TrainBatches` is what the loop asks: the next step's batches, the validation batches, the data position
a checkpoint saves (`extra_key` names its entry in index.json's extra), and what the loop reports about the
data. `IndexedBatches` is the DataSampler over the `.bin`/`.idx` datasets (position: consumed samples);
`StreamBatches` the rank's `StreamLoader` (position: every stream's state, gathered over dp, so a resumed
run may have another dp), which also sums the bad-record counts over the data-parallel ranks after each
step and stops the run past `data.max_bad_records` / `data.max_bad_fraction`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megalite.config import Config
from megalite.data import DataBundle, DataSampler, make_batch
from megalite.data.loader import RankSlice, StreamLoader, counts_of, counts_vector
from megalite.data.packing import Counts, bad_summary, check_bad_records
from megalite.data.position import FIX, source_change, token_file_fingerprint
from megalite.errors import CheckpointError, DataError
from megalite.parallel import comm
from megalite.parallel.state import ParallelState
from megalite.training.stop import StopFlag

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainBatches(Protocol):
    extra_key: str

    def next_step(self, stop: StopFlag) -> list[Batch] | None: ...

    def validation(self) -> list[Batch] | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...

    def after_step(self) -> dict[str, Any] | None: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class IndexedBatches:
    """The DataSampler over `.bin`/`.idx` samples (megalite/data/sampler.py)."""

    extra_key = "sampler"

    def __init__(self, cfg: Config, data: DataBundle, state: ParallelState) -> None:
        tr = cfg.train
        assert data.train is not None
        self.cfg, self.data, self.state = cfg, data, state
        self.sampler = DataSampler(len(data.train), tr.global_batch_size, tr.micro_batch_size, state.dp_rank,
                                   state.dp, tr.seed)
        # Each token file's content digest: a resume on files rewritten since is refused, naming them.
        self.sources = [token_file_fingerprint(p) for p in cfg.data.path]

    def next_step(self, stop: StopFlag) -> list[Batch] | None:
        assert self.data.train is not None
        return [make_batch(self.data.train, idx, self.state.cp, self.state.cp_rank) for idx in self.sampler.next_step()]

    def validation(self) -> list[Batch] | None:
        tr, state, valid = self.cfg.train, self.state, self.data.valid
        if valid is None:
            return None
        # The same batches every time (a fixed seed, a fresh sampler), so successive values compare.
        sampler = DataSampler(len(valid), tr.global_batch_size, tr.micro_batch_size, state.dp_rank, state.dp,
                              tr.seed + 1)
        return [make_batch(valid, idx, state.cp, state.cp_rank) for _ in range(tr.eval_steps) for idx in sampler.next_step()]

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "sources": self.sources}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        saved = d.get("sources")  # absent in a checkpoint written before the digests: not compared
        if isinstance(saved, list) and all(isinstance(s, dict) for s in saved):
            why = (f"the checkpoint read {len(saved)} data paths, this run has {len(self.sources)}"
                   if len(saved) != len(self.sources)
                   else next((c for a, b in zip(saved, self.sources) if (c := source_change(a, b)) is not None), None))
            if why is not None:
                if self.cfg.data.on_change != "restart":
                    raise DataError(f"{why}: {FIX}")
                if self.state.rank == 0:
                    print(f"data: {why}; data.on_change restart: reading the data from its start", flush=True)
                return
        elif saved is not None:
            raise CheckpointError(f"the checkpoint's extra.sampler.sources is garbled ({type(saved).__name__}): load "
                                  "an earlier checkpoint")
        self.sampler.load_state_dict(d)

    def after_step(self) -> dict[str, Any] | None:
        return None

    def describe(self) -> str:
        assert self.data.train is not None
        return f"{len(self.data.train)} train samples"

    def close(self) -> None:
        pass


class StreamBatches:
    """The streamed raw sources (megalite/data/loader.py), this rank's block of streams."""

    extra_key = "data_stream"

    def __init__(self, cfg: Config, data: DataBundle, state: ParallelState) -> None:
        self.cfg, self.state = cfg, state
        self.loader = StreamLoader(cfg, RankSlice(state.dp, state.dp_rank, state.cp, state.cp_rank), data.tokenizer)
        self.counts = Counts()
        for note in self.loader.skipped:
            self._note(note)

    def _note(self, text: str) -> None:
        if self.state.rank == 0:
            print(text, flush=True)

    def next_step(self, stop: StopFlag) -> list[Batch] | None:
        """The step's batches, or None when a stop signal came while a rank waited for them: the loader's wait
        is cut short by the signal, and every rank agrees before the step (a rank whose data was ready stops
        too, its batches put back, so a resumed run reads them)."""
        batches = self.loader.next_step(lambda: stop.requested)
        stopping = stop.agreed(self.state) if self.state.world_size > 1 else batches is None
        if not stopping:
            return batches
        if batches is not None:
            self.loader.untake()
        return None

    def validation(self) -> list[Batch] | None:
        return self.loader.validation(self.cfg.train.eval_steps)

    def state_dict(self) -> dict[str, Any]:
        """Every stream's state: each dp rank's own, gathered (a collective: every rank calls it)."""
        return self.loader.position(lambda obj: comm.all_gather_object(obj, self.state, "dp", "checkpoint"))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        try:
            note = self.loader.load_position(d)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"the checkpoint's data position (extra.data_stream) is garbled ({type(e).__name__}: "
                                  f"{e}): load an earlier checkpoint") from e
        if note is not None:
            self._note(note)

    def after_step(self) -> dict[str, Any]:
        """The run's records and bad records so far (summed over dp; every rank agrees), checked against the
        limits; the loader's speed and this rank's wait for data."""
        vec = torch.tensor(counts_vector(self.loader.counts()), dtype=torch.int64, device=self.state.device)
        if self.state.dp > 1:
            comm.all_reduce(vec, self.state, "dp", count_as="metrics")
        self.counts = counts_of(vec.tolist())
        data = self.cfg.data
        check_bad_records(self.counts, int(data.max_bad_records), float(data.max_bad_fraction))
        return {**self.loader.report(), "records": self.counts.records,
                "bad_records": {k: v for k, v in self.counts.bad.items() if v}}

    def describe(self) -> str:
        return f"streamed data: {self.loader.streams} streams, {self.cfg.data.workers} tokenizer workers per rank"

    def progress(self) -> str:
        rep = self.loader.report()
        rate = rep["loader_tokens_per_s"]
        return (f"data: {self.counts.records} records read, {bad_summary(self.counts)} | loader "
                + (f"{rate:,.0f} tok/s" if rate else "starting") + f", {rep['ahead']} steps ahead, waited "
                f"{rep['total_wait_s']:.2f} s in all")

    def close(self) -> None:
        self.loader.close()


def build_batches(cfg: Config, data: DataBundle, state: ParallelState) -> TrainBatches:
    if data.train is None:
        return StreamBatches(cfg, data, state)
    return IndexedBatches(cfg, data, state)
