"""Fault injection for testing a job's resilience (and the infrastructure around it).

Set MEGALITE_FAULT to one or more `;`-separated faults, each `KIND:key=value:...`:
    kill:rank=1:step=5     SIGKILL this process at the start of step 5 on global rank 1
    hang:rank=1:step=5     sleep forever at the start of step 5 on rank 1 (the watchdog should fire)
    nan:step=3             make the gradient non-finite at step 3 (all ranks) — use step=3-9 for a range
    kill_save:rank=0:step=4  SIGKILL while step 4's checkpoint is written, after the rank's file is written and
                           before the checkpoint is published (the worst moment: all data on disk, no index)
Faults fire only on a first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so a run restarted by
`torchrun --max-restarts` goes on normally. Nothing happens when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None
    first_step: int
    last_step: int

    def hits(self, rank: int, step: int) -> bool:
        return (self.rank is None or self.rank == rank) and self.first_step <= step <= self.last_step


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        kind, *pairs = item.split(":")
        kv = dict(p.split("=", 1) for p in pairs)
        lo, _, hi = kv.get("step", "1").partition("-")
        faults.append(Fault(kind, int(kv["rank"]) if "rank" in kv else None, int(lo), int(hi or lo)))
    return faults


class FaultInjector:
    def __init__(self, rank: int, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        first_attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.rank = rank
        self.faults = parse_faults(env.get("MEGALITE_FAULT", "")) if first_attempt else []

    def at_step_start(self, step: int) -> None:
        for f in self.faults:
            if f.hits(self.rank, step) and f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.hits(self.rank, step) and f.kind == "hang":
                while True:
                    time.sleep(3600)

    def in_save(self, step: int, barrier: int) -> None:
        """Called before each barrier of a checkpoint write; the second follows this rank's durable file."""
        if barrier == 2 and any(f.kind == "kill_save" and f.hits(self.rank, step) for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_grads(self, step: int) -> bool:
        """True when this step's gradients should be made non-finite."""
        return any(f.kind == "nan" and f.hits(self.rank, step) for f in self.faults)
