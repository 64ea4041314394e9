"""Resuming from and saving the run's checkpoints: model, optimizer, data position, loss scale, RNG."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.nn as nn

from megalite.checkpoint import sharded
from megalite.checkpoint.async_save import AsyncSaver, Outcome, raise_if_failed
from megalite.config import CheckpointConfig, aliases
from megalite.errors import CheckpointError
from megalite.optim.loss_scale import LossScaler
from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState
from megalite.runtime.faults import FaultInjector
from megalite.training.init_from import init_note

Note = Callable[[str], None]


class DataPosition(Protocol):
    """Where the data stream stands (the sampler, or the streamed sources' positions): saved in a checkpoint's
    extra state under `extra_key`, restored on resume."""

    extra_key: str

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...


def check_same_optimizer(index: dict, mine: str, path: Path) -> None:
    """Refuse to resume with another `optimizer.name` (`mine`) than the checkpoint's: AdamW's first moment and
    Muon's momentum share the "exp_avg" slot but are different things (docs/muon.md). A checkpoint with no
    run config (an imported model) carries no optimizer state and may start either."""
    config = aliases.saved_config(index.get("extra"))  # saved before [optimizer]: its optimizer.name
    if not config:  # no run config (or an unreadable one: the loader reports that)
        return
    section = config.get("optimizer")
    saved = section.get("name", "adamw") if isinstance(section, dict) else "adamw"  # from before Muon: AdamW
    if saved != mine:
        raise CheckpointError(f"checkpoint {path} was trained with optimizer.name={saved}, this run has "
                              f"optimizer.name={mine}: switching optimizers on resume is not supported; resume "
                              f"with --optimizer.name {saved} or start fresh (checkpoint.load=none)")


@dataclass
class RunCheckpoints:
    """Everything a checkpoint holds besides the tensors' layout, which `sharded` works out."""

    settings: CheckpointConfig
    config: dict                 # the resolved run config, saved for the record
    model: nn.Module             # this rank's chunks
    optimizer: DistributedOptimizer
    sampler: DataPosition
    scaler: LossScaler
    rng: RNGStreams
    state: ParallelState
    last_saved: Path | None = None
    saver: AsyncSaver | None = field(default=None, init=False)  # checkpoint.async_save: the background writer
    init_note: str = field(default="", init=False)  # what `init_weights` took, added and left (one line)

    def __post_init__(self) -> None:
        if self.settings.async_save and self.settings.dir:  # every rank builds it (it makes a process group)
            faults = FaultInjector(self.state.rank)
            self.saver = AsyncSaver(self.state, float(self.config.get("parallel", {}).get("timeout_s", 600.0)),
                                    pin=self.state.device.type == "cuda", on_barrier=faults.in_save)

    def resume(self) -> tuple[str | None, int]:
        """Load the checkpoint `checkpoint.load` names (or the newest in `checkpoint.dir`), if any:
        (where from, its step); (None, 0) for a fresh run."""
        path = sharded.find(self.settings.load, self.settings.dir)
        if path is None:
            return None, 0
        check_same_optimizer(sharded.read_index(path), self.config["optimizer"]["name"], path)
        # Any layout: each rank reads the slices it needs (ZeRO-3: into temporarily gathered params).
        with self.optimizer.gathered():
            extra = sharded.load_sharded(path, self.model, self.optimizer, self.state)
        if self.sampler.extra_key in extra:  # an imported Hugging Face model has no data position
            self.sampler.load_state_dict(extra[self.sampler.extra_key])
        if "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        if extra["rng"] is not None:  # same layout: restore every rank's streams; else keep the fresh seeds
            self.rng.load_state_dict(extra["rng"])
        return str(path), int(extra["step"])

    def init_weights(self, path: Path) -> None:
        """`train.init_from`: the weights of checkpoint `path` (any layout), nothing else: the optimizer's
        moments, the step and schedule, the data position, the loss scale and the RNG streams stay fresh."""
        with self.optimizer.gathered():
            extra = sharded.load_sharded(path, self.model, self.optimizer, self.state, weights_only=True)
        self.init_note = init_note(self.config["train"]["init_from"], extra["fresh"], extra["left"])

    def due(self, step: int, total_steps: int) -> bool:
        """Every `checkpoint.interval` steps and at the end, when `checkpoint.dir` is set."""
        every = self.settings.interval > 0 and step % self.settings.interval == 0
        return bool(self.settings.dir) and (every or step == total_steps)

    def save(self, step: int, note: Note) -> Path | None:
        """Write step `step`'s checkpoint (no-op without `checkpoint.dir`); returns its directory, or None
        when it is being written in the background (`poll` / `finish` report it once published)."""
        if not self.settings.dir:
            return None
        self.optimizer.finish_param_sync()  # the model's parameters are read: none may still be in flight
        extra = {"config": self.config, self.sampler.extra_key: self.sampler.state_dict(),
                 "scaler": self.scaler.state_dict(), "rng": self.rng.state_dict()}
        if self.saver is None:
            self.last_saved = Path(sharded.save_sharded(self.settings.dir, step, self.model, self.optimizer, extra,
                                                        self.state, self.settings.keep))
            return self.last_saved
        busy = self.saver.busy()
        if busy is not None:  # at most one save in flight: this one waits, and says so
            note(f"checkpoint step {step}: waiting for the save of step {busy}, still being written (a save takes "
                 "longer than checkpoint.interval steps)")
        waited, outcome = self.saver.wait()
        self._report(outcome, note)
        if busy is not None:
            note(f"checkpoint step {step}: waited {waited:.2f} s for the save of step {busy}")
        plan = sharded.plan_save(self.settings.dir, step, self.model, self.optimizer, extra, self.state,
                                 self.settings.keep)
        copy_s = self.saver.submit(plan)
        note(f"checkpoint step {step}: copied {self.saver.buffers.nbytes / 2**20:.1f} MiB to host memory in "
             f"{copy_s:.3f} s; writing in the background")
        return None

    def poll(self, note: Note) -> None:
        """Report a background save that has finished (its error as one CheckpointError); never blocks."""
        if self.saver is not None:
            self._report(self.saver.done(), note)

    def finish(self, note: Note, quiet: bool = False) -> None:
        """Wait for the save in flight (end of run, stop signal, error); `quiet`: an error is already being
        raised, so a failed save is only noted, not raised over it."""
        if self.saver is None:
            return
        _, outcome = self.saver.wait()
        if quiet and outcome is not None and outcome.error is not None:
            note(f"the background save of step {outcome.step} failed too: {outcome.error}")
            return
        self._report(outcome, note)

    def _report(self, outcome: Outcome | None, note: Note) -> None:
        path = raise_if_failed(outcome)
        if path is not None and outcome is not None:
            self.last_saved = path
            note(f"saved checkpoint {path} (written in the background in {outcome.write_s:.2f} s)")
