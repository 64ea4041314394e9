"""When the gradient sync's data-parallel collectives run: bucket sizes, the parameter-gather overlap,
ZeRO-3's prefetch depth, and a typed record of what was launched and waited on when.

Three overlaps hide DP communication behind compute (none changes what is computed):

- **Gradient reduction during the backward** (every stage): a bucket's all-reduce / reduce-scatter
  starts as soon as its last gradient of the last micro-batch arrives. Gradients become ready in
  reverse layer order, so the *first* bucket (the output layer's) is kept small (`first_bucket_bytes`,
  1 MiB like PyTorch DDP's first bucket): its reduction starts early in the backward instead of after
  the whole model (one 25 MiB bucket holds a small model entirely). Later buckets are sized for
  bandwidth (`bucket_bytes`, 25 MiB).
- **Parameter all-gather during the next forward** (ZeRO-1/2, `param_gather`): the step launches each
  bucket's all-gather of the updated parameters and returns; a forward pre-hook on every module that
  owns parameters waits for its buckets just before it runs (Megatron-LM's overlapped parameter gather).
  Whatever reads the parameters between steps without a forward (checkpoint save, generation, tests)
  first calls `finish_param_sync()`.
- **ZeRO-3 prefetch** (`zero3_prefetch` units ahead): while one unit computes, the all-gathers of the
  next units (forward order in the forward, reverse order in the backward) are already in flight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, TypeVar

import torch.distributed as dist
import torch.nn as nn

from megalite.dp.buckets import Bucket
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

MiB = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * MiB       # PyTorch DDP's default: big enough to amortise a collective's latency
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB  # PyTorch DDP's first bucket: the output layer's reduction starts early


def mib_to_bytes(mib: float) -> int:
    """A bucket size from its config value in MiB (at least one byte)."""
    return max(1, round(mib * MiB))


@dataclass(frozen=True)
class OverlapSettings:
    """How the gradient sync schedules its DP collectives (`parallel.bucket_mb`, `first_bucket_mb`,
    `overlap_param_gather`, `zero3_prefetch`). Results are identical for every setting."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    param_gather: bool = True  # ZeRO-1/2: wait for a bucket's gather in the next forward, not at the step's end
    zero3_prefetch: int = 1    # ZeRO-3: units gathered ahead of the one computing (0 = none)

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0 or self.first_bucket_bytes <= 0 or self.zero3_prefetch < 0:
            raise ValueError(f"invalid {self}: bucket sizes must be > 0 and zero3_prefetch >= 0")


EventKind = Literal["reduce", "gather", "gather_wait"]


@dataclass(frozen=True)
class OverlapEvent:
    """`kind` happened to bucket `bucket` (its index in `GradSync.buckets`): "reduce" = its gradient
    reduction was launched, "gather" = its parameter all-gather was launched, "gather_wait" = that gather
    was waited on. Tests and benchmarks read the order of these against the model's own hooks."""

    kind: EventKind
    bucket: int


EventSink = Callable[[OverlapEvent], None]


class ParamGatherOverlap:
    """ZeRO-1/2's parameter all-gathers, launched at the end of a step and waited on lazily: each module
    that owns parameters gets a forward pre-hook that waits for the buckets holding them (the first
    module to run waits; later ones find nothing pending). With `overlap=False` `launch` waits at once."""

    def __init__(self, model: nn.Module, buckets: list[Bucket], state: ParallelState, overlap: bool,
                 on_event: EventSink | None) -> None:
        self.buckets, self.state, self.overlap, self.on_event = buckets, state, overlap, on_event
        self._pending: dict[int, dist.Work] = {}
        if not overlap:
            return
        index = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        for m in model.modules():
            mine = sorted({index[id(p)] for p in m.parameters(recurse=False) if id(p) in index})
            if mine:
                m.register_forward_pre_hook(functools.partial(self._before_forward, mine))

    def launch(self) -> None:
        """All-gather every bucket's updated shard into its full buffer (async when overlapping)."""
        self.finish()
        # In forward order (buckets are in backward order): collectives on one communicator complete in
        # the order they were launched, so the first module's bucket must not queue behind the head's.
        for i in reversed(range(len(self.buckets))):
            b = self.buckets[i]
            # A copy of the own range: the gather's output buffer contains it, and an input must not alias it.
            work = comm.all_gather_async(b.param_flat, b.param_flat[b.lo:b.hi].clone(), self.state, b.group)
            self._emit("gather", i)
            if work is not None:
                self._pending[i] = work
        if not self.overlap:
            self.finish()

    def _before_forward(self, buckets: list[int], module: nn.Module, args: Any) -> None:
        if self._pending:
            for i in buckets:
                self._wait(i)

    def _wait(self, i: int) -> None:
        work = self._pending.pop(i, None)
        if work is not None:
            work.wait()
            self._emit("gather_wait", i)

    def finish(self) -> None:
        """Wait for every gather still in flight (the parameters are whole and current afterwards)."""
        for i in list(self._pending):
            self._wait(i)

    def _emit(self, kind: EventKind, bucket: int) -> None:
        if self.on_event is not None:
            self.on_event(OverlapEvent(kind, bucket))


T = TypeVar("T")


def ahead(units: list[T], i: int, step: int, depth: int) -> list[T]:
    """The (at most) `depth` units after position `i` in direction `step` (+1: forward, -1: backward)."""
    return [units[j] for j in range(i + step, i + step * (depth + 1), step) if 0 <= j < len(units)]
