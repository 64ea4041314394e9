"""Asynchronous checkpoint saves (`checkpoint.async_save true`): the loop pays for a copy, not for the disk.

A save is split where the tensors stop being needed live (`megalite.checkpoint.sharded.plan_save` /
`write_planned`):

1. on the training thread, `snapshot` copies this rank's share of the checkpoint (its slices of the fp32
   parameters and Adam moments, its RNG states) into host buffers: pinned memory on a GPU, so the copy
   runs at the link's speed, plain tensors on a CPU. The buffers are kept and reused by the next save,
   so the extra host memory is one copy of the rank's share, allocated once;
2. a background thread writes the copies exactly as a synchronous save would (same files, same bytes,
   same sha256, same step_N.tmp -> step_N rename, `latest` moved last), while training goes on.

At most one save is in flight: the next one first waits for it (and says so in the log, with the time
waited), so the host buffers are never overwritten while being written. The barriers between ranks that
the write needs (every file durable before rank 0 publishes) run on a process group of their own (gloo,
made once by every rank at start), never on the training's groups, whose collectives the main thread
issues meanwhile. An error in the writer is raised on the training thread at its next `poll` (one
line, a CheckpointError); the end of the run and a stop signal wait for the save in flight.
kill -9 during a write leaves only step_N.tmp: `latest` still names the previous complete checkpoint.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megalite.checkpoint.sharded import SavePlan, write_planned
from megalite.errors import CheckpointError, MegaliteError
from megalite.parallel.state import ParallelState


class HostBuffers:
    """Host copies of a save's slabs, reused from one save to the next (same keys, shapes and dtypes)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def snapshot(self, plan: SavePlan) -> SavePlan:
        """`plan` with every slab replaced by a host copy taken now (the copies are complete on return)."""
        copies: list[tuple[str, torch.Tensor]] = []
        on_gpu = False
        for key, t in plan.slabs:
            dtype = torch.uint8 if key.startswith("rng/") else torch.float32
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype:
                buf = torch.empty(t.shape, dtype=dtype, pin_memory=self.pin)
                self._buffers[key] = buf
            on_gpu |= t.device.type == "cuda"
            buf.copy_(t, non_blocking=on_gpu and self.pin)  # pinned: an async DMA, waited for below
            copies.append((key, buf))
        if on_gpu:
            torch.cuda.synchronize()  # the copies must be complete before the optimizer changes the tensors
        return replace(plan, slabs=copies)


@dataclass
class Outcome:
    """What a finished background save left for the training thread to report."""

    step: int
    path: Path | None
    error: BaseException | None
    write_s: float


class AsyncSaver:
    """One background writer, at most one save in flight; every rank makes one (collectively) at start."""

    def __init__(self, state: ParallelState, timeout_s: float, pin: bool,
                 on_barrier: Callable[[int, int], None] | None = None) -> None:
        self.state = state
        self.buffers = HostBuffers(pin)
        # Its own group: the writer's barriers must never interleave with the training thread's collectives.
        self._group: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
            if state.world_size > 1 else None
        self.on_barrier = on_barrier  # fault/test hook: (step, barrier number) before each barrier of a write
        self._thread: threading.Thread | None = None
        self._outcome: Outcome | None = None

    def busy(self) -> int | None:
        """The step whose save is still being written, or None."""
        thread = self._thread
        return int(thread.name.rsplit("-", 1)[1]) if thread is not None and thread.is_alive() else None

    def _barrier_for(self, step: int) -> Callable[[], None]:
        count = [0]

        def barrier() -> None:
            count[0] += 1
            if self.on_barrier is not None:
                self.on_barrier(step, count[0])
            if self._group is not None:
                dist.barrier(group=self._group)
        return barrier

    def _write(self, plan: SavePlan) -> None:
        t0 = time.perf_counter()
        try:
            path = write_planned(plan, self._barrier_for(plan.step))
            self._outcome = Outcome(plan.step, path, None, time.perf_counter() - t0)
        except BaseException as e:  # kept for the training thread: a thread's exception would be lost
            self._outcome = Outcome(plan.step, None, e, time.perf_counter() - t0)

    def wait(self) -> tuple[float, Outcome | None]:
        """Block until the save in flight (if any) is written: (seconds waited, its outcome)."""
        if self._thread is None:
            return 0.0, None
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        return time.perf_counter() - t0, outcome

    def done(self) -> Outcome | None:
        """The outcome of a save that has finished since the last call, without blocking; else None."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()[1]

    def submit(self, plan: SavePlan) -> float:
        """Copy `plan`'s tensors now and write them in the background; returns the seconds spent copying.
        The caller has waited for the previous save (`wait`)."""
        if self._thread is not None:
            raise RuntimeError("a save is still in flight: wait() for it first (a megalite bug, please report)")
        t0 = time.perf_counter()
        copied = self.buffers.snapshot(plan)
        seconds = time.perf_counter() - t0
        # Not a daemon: an interpreter that exits without `wait` (an unexpected path) still finishes the write.
        self._thread = threading.Thread(target=self._write, args=(copied,), name=f"megalite-save-{plan.step}")
        self._thread.start()
        return seconds


def raise_if_failed(outcome: Outcome | None) -> Path | None:
    """The published directory of a finished save, or its error as one CheckpointError line."""
    if outcome is None:
        return None
    if outcome.error is not None:
        e = outcome.error
        if isinstance(e, MegaliteError):
            raise e
        raise CheckpointError(f"the background save of step {outcome.step} failed: {type(e).__name__}: {e}") from e
    return outcome.path
