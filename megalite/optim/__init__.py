"""Optimizers: the maths on the shards the gradient sync hands over, and its composition with the sync.

`shard_adamw.py` is AdamW on `megalite.dp.shards.Shard`s, `muon.py` (with `muon_math`, `muon_plan`,
`muon_exchange`) Muon on the same shards; `zero.py` composes a `megalite.dp.GradSync` with one of them behind
`protocol.py`'s `DistributedOptimizer` (what the training step and the checkpoints call), and
`build.py`'s `build_distributed_optimizer` builds that composition. Both live here, not in `megalite.dp`,
because a composition must import both parts: the sync sits below the optimizers and never imports them.
`config.py` holds the `[optimizer]` and `[muon]` config sections (torch-free); `reference.py` is the replicated
oracle the tests compare with; `schedule.py` the LR schedule; the private torch APIs used are in
`megalite/torch_private.py`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The config sections (`megalite.optim.config`) must import without torch: importing them runs this file first,
# so the torch-based exports are imported on first use (PEP 562's module `__getattr__`), not here.
_EXPORTS = {"build_distributed_optimizer": "build", "SyncOptions": "build", "DistributedOptimizer": "protocol",
            "ZeroOptimizer": "zero", "ShardAdamW": "shard_adamw", "ShardMuon": "muon", "OPTIMIZERS": "config"}

if TYPE_CHECKING:
    from megalite.optim.build import SyncOptions, build_distributed_optimizer
    from megalite.optim.config import OPTIMIZERS
    from megalite.optim.muon import ShardMuon
    from megalite.optim.protocol import DistributedOptimizer
    from megalite.optim.shard_adamw import ShardAdamW
    from megalite.optim.zero import ZeroOptimizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalite.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megalite.optim.{_EXPORTS[name]}"), name)


__all__ = ["build_distributed_optimizer", "SyncOptions", "DistributedOptimizer", "ZeroOptimizer", "ShardAdamW",
           "ShardMuon", "OPTIMIZERS"]
