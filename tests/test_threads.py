"""The intra-op thread decision (megalite/runtime/threads.py): cores shared by the processes of this machine,
an explicit OMP_NUM_THREADS always wins; pure functions, every branch."""

from __future__ import annotations

import pytest

from megalite.runtime.threads import choose_threads, local_processes


@pytest.mark.parametrize("cores,processes,env,threads", [
    (16, 1, None, 16),     # alone: every core
    (16, 4, None, 4),      # torchrun --nproc-per-node 4: a quarter each, 16 threads in all
    (2, 4, None, 1),       # more processes than cores: never below 1 (and never 2 x 4 on 2 cores)
    (6, 4, None, 1),       # floor: 4 threads on 6 cores, not 8
    (8, 0, None, 8),       # a nonsensical count is taken as 1 process
    (2, 4, "3", 3),        # the user's OMP_NUM_THREADS wins, even when it oversubscribes
    (16, 1, "1", 1),
    (16, 2, "0", 8),       # not a usable value: ignored
    (16, 2, "lots", 8),
])
def test_choose_threads(cores: int, processes: int, env: str | None, threads: int) -> None:
    choice = choose_threads(cores, processes, env)
    assert choice.threads == threads
    usable = env is not None and env.isdigit() and int(env) >= 1
    assert ("OMP_NUM_THREADS" in choice.reason) == usable


def test_local_processes_reads_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert local_processes(1) == 1 and local_processes(8) == 8  # no launcher info: the whole world
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x3)")
    assert local_processes(6) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, first
    assert local_processes(8) == 4
