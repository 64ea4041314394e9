"""A pool of gloo worker processes for multi-process tests.

Starting a process costs seconds (importing torch); a 2-core machine cannot afford that per check.
So a `DistWorld` of N ranks is started once per world size per test session, and each test ships
a picklable top-level function to every rank, which runs it as `fn(rank, *args)` and returns a value.
Failures are reported with the rank and its traceback; a failed world is torn down and restarted on
the next use, because a rank that died mid-collective leaves its peers stuck until the timeout.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable

# Hang guards only, as long as pytest's own per-test limit: a peer may be slow to reach a collective
# on a loaded machine without anything being wrong.
COLLECTIVE_TIMEOUT_S = 300.0


def _worker(rank: int, world: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks on 2 cores: oversubscribed threads only slow everyone down
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, *args)))
        except BaseException:  # report everything, including assertion failures, with the rank
            results.put((rank, False, traceback.format_exc()))
        _drop_groups()
    # Every result was read before the stop came, so nothing is left to flush. Leave without tearing down the
    # groups and the interpreter: that orderly exit cost ~0.5-1 CPU-second per rank, 14 ranks per session.
    os._exit(0)


def _drop_groups() -> None:
    """Destroy the process groups the last task made and nothing keeps (most tests build a fresh ParallelState).

    A gloo group owns three threads (two run loops and a TCP event loop) that live as long as the group. A rank of
    the pool outlives hundreds of tests, so without this it ended a session with ~600 threads, whose event loops
    kept waking up: the 2-core machine spent a growing share of its time on them and the suite slowed as it went.
    Kept: the world group and the layouts tests cache on purpose (`_GROUPS` of tests/parallel_utils.py and
    tests/moe_utils.py, reused by later tasks). Dropping a group is local bookkeeping (no collective); the collection
    joins its threads once nothing refers to it."""
    import gc
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    kept = {id(c10d.GroupMember.WORLD)}
    for module in ("tests.parallel_utils", "tests.moe_utils"):
        for state in getattr(sys.modules.get(module), "_GROUPS", {}).values():
            kept.update(id(pg) for pg in state.groups.values())
    for pg in list(c10d._world.pg_map):
        if id(pg) not in kept:
            dist.destroy_process_group(pg)
    gc.collect()


def _context() -> Any:
    """Ranks forked from a server process that imported torch once (and ran nothing: no OpenMP or gloo thread
    exists to be forked), instead of each rank importing torch itself (~1.5 CPU-seconds a rank, 14 ranks in a
    session): the same clean processes as "spawn", started for a fraction of the CPU."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: every rank's first torch.optim optimizer imports it (and sympy) lazily, ~1.4 CPU-s a rank.
    # Importing it starts no thread, so the forked ranks stay as clean as before.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


class DistWorld:
    """N gloo ranks waiting for work. `run(fn, *args)` returns [fn(0, *args), ..., fn(N-1, *args)]."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        fd, init_file = tempfile.mkstemp(prefix="megalite-dist-")
        os.close(fd)
        os.remove(init_file)  # the file store must not exist yet
        self._init_file = init_file
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, init_file, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        if not self._procs or any(not p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        failures: list[str] = []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(out) + len(failures) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = self._results.get(timeout=max(left, 0.1))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(out))
                self.close()
                raise AssertionError(f"{fn.__name__}: ranks {missing} did not answer within {timeout:.0f}s"
                                     + ("".join(failures) and "\n" + "\n".join(failures)))
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} failed in {fn.__name__}:\n{value}")
        if failures:
            self.close()  # peers may be stuck in a collective: restart cleanly next time
            raise AssertionError("\n".join(failures))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
        if os.path.exists(self._init_file):
            os.remove(self._init_file)  # the ranks exit without closing the file store (see _worker)
