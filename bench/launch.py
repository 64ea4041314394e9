"""How the benchmarks start their ranks: `spawn_ranks` runs a worker function in `world` spawned processes
and returns what rank 0 put on the queue; `run_script_ranks` launches a script's `--worker` mode under
torchrun (one plain process when nproc is 1) with a clean launcher environment and a fixed thread count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def spawn_ranks(worker: Callable[..., None], world: int, port: int, args: Any, timeout_s: float = 3600) -> Any:
    """Start `worker(rank, world, port, args, queue)` in `world` processes; return the first item put on the
    queue once every process has exited cleanly (a RuntimeError naming the exit code otherwise)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout_s)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank exited with {p.exitcode}")
    return result


def run_script_ranks(script: Path, nproc: int, argv: list[str], threads: int,
                     timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`script --worker ARGV` in `nproc` ranks (torchrun when more than one), `threads` OpenMP threads each,
    the caller's own launcher variables removed so a benchmark run inside a job does not join that job.
    `--standalone`: torchrun binds a free port itself, so concurrent benchmarks (or tests) never collide."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([*launcher, str(script), "--worker", *argv], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=timeout_s)


def start_pretrain(argv: list[str], run_dir: Path, threads: int) -> subprocess.Popen:
    """`pretrain.py ARGV` as one plain process in the background, `threads` OpenMP threads, the launcher
    variables removed, its output in `run_dir`.log (the curve benchmarks start their variants together)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    log = open(run_dir.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, str(REPO / "pretrain.py"), *argv], cwd=str(REPO), env=env, stdout=log,
                            stderr=subprocess.STDOUT)
