"""How many CPU threads each process's torch ops use: the cores this process may run on, shared by the
processes of this machine, unless the user said otherwise.

torch's default is one intra-op thread per core *per process*. Under torchrun with N processes on C cores
that is N x C threads on C cores; OpenMP's threads then wait for each other at every parallel region
while the kernel runs someone else's, so each step costs several times the CPU time it needs
(bench/threads.py measures it: docs/performance.md quotes the table). `cores // local processes` (at
least 1) keeps one thread per core in total, which costs little when the machine is idle and degrades
gracefully when it is not. An explicit `OMP_NUM_THREADS` always wins (launch/torchrun.sh sets the same
value; plain torchrun sets 1 when it starts several processes).

OpenMP's wait policy is read once, when torch loads its OpenMP runtime: pretrain.py sets
`OMP_WAIT_POLICY=PASSIVE` before importing torch unless the user set it (waiting threads sleep instead of
spinning on a core another process needs; see the measurement for what it costs on an idle machine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # intra-op threads for this process
    reason: str  # one phrase for the startup log: where the number comes from


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a Slurm cgroup)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_threads(cores: int, local_processes: int, omp_num_threads: str | None) -> ThreadChoice:
    """Intra-op threads for one of `local_processes` processes sharing `cores` cores. Pure (a test checks
    every branch): `omp_num_threads` is the environment's OMP_NUM_THREADS (None when unset)."""
    if omp_num_threads is not None and omp_num_threads.strip().isdigit() and int(omp_num_threads) >= 1:
        return ThreadChoice(int(omp_num_threads), "OMP_NUM_THREADS")
    processes = max(1, local_processes)
    threads = max(1, cores // processes)
    share = f"{cores} cores / {processes} processes" if processes > 1 else f"{cores} cores"
    return ThreadChoice(threads, share)


def local_processes(world_size: int) -> int:
    """Processes of this job on this machine: the launcher's LOCAL_WORLD_SIZE (torchrun), else Slurm's tasks
    per node, else the whole world (a safe overestimate: fewer threads, never oversubscription)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0]  # Slurm writes e.g. "2(x3)"
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return max(1, world_size)


def configure_threads(local_processes: int) -> str:
    """Apply `choose_threads` to this process (torch.set_num_threads); returns the startup log's line."""
    import torch

    choice = choose_threads(available_cores(), local_processes, os.environ.get("OMP_NUM_THREADS"))
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    policy = os.environ.get("OMP_WAIT_POLICY", "the OpenMP default")
    return f"threads: {choice.threads} intra-op per process ({choice.reason}), OMP_WAIT_POLICY {policy}"
