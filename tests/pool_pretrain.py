"""`pretrain.py` at N ranks inside the warm `DistWorld` ranks (tests/dist_harness.py), not a new torchrun job.

A torchrun job of N ranks pays N + 1 interpreter start-ups, each importing torch and megalite (2-3 CPU-seconds
apiece), before its first step: on a 2-core machine that was most of the cost of the end-to-end layout and
cp-mode tests. The pool's ranks already share a gloo process group; `trainer.main` joins it (`init_distributed`
keeps a default group that exists, and a run that did not start the group leaves it for the next run), with the
launcher's variables set as torchrun sets them. Everything after the rendezvous is the same code: config,
data, model, optimizer, checkpoints, metrics.

What only a real launch shows stays in tests that launch one: torchrun's rendezvous and a config error printed
once (tests/test_pretrain.py), restarts after a killed rank and resuming in fresh processes (tests/test_reliability.py,
tests/test_async_save.py), signals (tests/test_stop_signals.py), Slurm and two agents (tests/test_launch.py).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from tests.dist_harness import DistWorld


@dataclass(frozen=True)
class PoolRun:
    """What a torchrun job reports: the first failing rank's exit code (else 0) and every rank's output."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def launched_env(rank: int, world: int) -> Iterator[None]:
    """torchrun's variables for this warm rank (MASTER_* only pass the launcher checks: the process group exists
    already), put back afterwards so the rank's next task sees the environment it started with."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pretrain_rank(rank: int, world: int, argv: list[str]) -> tuple[int, str, str]:
    from megalite.training.trainer import main

    out, err = io.StringIO(), io.StringIO()
    with launched_env(rank, world), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def run_pretrain_in_pool(dist_world: Callable[[int], DistWorld], args: list[str], nproc: int) -> PoolRun:
    """`torchrun --nproc-per-node nproc pretrain.py *args`, run by the session's warm ranks of that world size."""
    results = dist_world(nproc).run(_pretrain_rank, nproc, list(args))
    codes = [code for code, _, _ in results]
    return PoolRun(next((c for c in codes if c != 0), 0), "".join(o for _, o, _ in results),
                   "".join(e for _, _, e in results))
