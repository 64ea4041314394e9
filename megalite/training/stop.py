"""Stop signals: SIGTERM/SIGUSR1 (what Slurm sends before a preemption) -> finish the step, save, exit 0.

The handlers are installed before the run builds anything, so a signal that arrives while data is read, the
model is built or a checkpoint is loaded is honoured too: the run stops before step 1 (nothing to save yet).
A second signal while the first is being honoured means "now": the default action runs (the process ends).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.state import ParallelState


class StopFlag:
    """Installs the handlers on construction; `agreed` is polled once per step."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # asked twice: stop at once, as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True

    def agreed(self, state: ParallelState) -> bool:
        """Stop only when every rank stops at the same step: all-reduce the flag (MAX)."""
        if state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=state.device)
        comm.all_reduce(flag, state, "mp", op=dist.ReduceOp.MAX, count_as="metrics")
        flag_all = torch.tensor([flag.item()], device=state.device)
        comm.all_reduce(flag_all, state, "dp_cp", op=dist.ReduceOp.MAX, count_as="metrics")  # mp x dp_cp: all
        return bool(flag_all.item())
