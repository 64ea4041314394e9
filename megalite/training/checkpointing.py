"""Resuming from and saving the run's checkpoints: model, optimizer, data position, loss scale, RNG."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from megalite.checkpoint import sharded
from megalite.config import CheckpointConfig
from megalite.data import DataSampler
from megalite.optim.adamw import LossScaler
from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState


@dataclass
class RunCheckpoints:
    """Everything a checkpoint holds besides the tensors' layout, which `sharded` works out."""

    settings: CheckpointConfig
    config: dict                 # the resolved run config, saved for the record
    model: nn.Module             # this rank's chunks
    optimizer: DistributedOptimizer
    sampler: DataSampler
    scaler: LossScaler
    rng: RNGStreams
    state: ParallelState
    last_saved: Path | None = None

    def resume(self) -> tuple[str | None, int]:
        """Load the checkpoint `checkpoint.load` names (or the newest in `checkpoint.dir`), if any:
        (where from, its step); (None, 0) for a fresh run."""
        path = sharded.find(self.settings.load, self.settings.dir)
        if path is None:
            return None, 0
        # Any layout: each rank reads the slices it needs (ZeRO-3: into temporarily gathered params).
        with self.optimizer.gathered():
            extra = sharded.load_sharded(path, self.model, self.optimizer, self.state)
        if "sampler" in extra:  # an imported Hugging Face model has no data position
            self.sampler.load_state_dict(extra["sampler"])
        if "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        if extra["rng"] is not None:  # same layout: restore every rank's streams; else keep the fresh seeds
            self.rng.load_state_dict(extra["rng"])
        return str(path), int(extra["step"])

    def due(self, step: int, total_steps: int) -> bool:
        """Every `checkpoint.interval` steps and at the end, when `checkpoint.dir` is set."""
        every = self.settings.interval > 0 and step % self.settings.interval == 0
        return bool(self.settings.dir) and (every or step == total_steps)

    def save(self, step: int) -> Path | None:
        """Write step `step`'s checkpoint (no-op without `checkpoint.dir`); returns its directory."""
        if not self.settings.dir:
            return None
        self.optimizer.finish_param_sync()  # the model's parameters are read: none may still be in flight
        extra = {"config": self.config, "sampler": self.sampler.state_dict(),
                 "scaler": self.scaler.state_dict(), "rng": self.rng.state_dict()}
        self.last_saved = Path(sharded.save_sharded(self.settings.dir, step, self.model, self.optimizer, extra,
                                                    self.state, self.settings.keep))
        return self.last_saved
