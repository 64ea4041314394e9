"""Optimizers: the maths on the shards the gradient sync hands over, and its composition with the sync.

`shard_adamw.py` is AdamW on `megalite.dp.shards.Shard`s, `muon.py` (with `muon_math`, `muon_plan`,
`muon_exchange`) Muon on the same shards; `zero.py` composes a `megalite.dp.GradSync` with one of them behind
`protocol.py`'s `DistributedOptimizer` (what the training step and the checkpoints call), and
`build_distributed_optimizer` below builds that composition. Both live here, not in `megalite.dp`, because a
composition must import both parts: the sync sits below the optimizers and never imports them.
`reference.py` is the replicated oracle the tests compare with; `schedule.py` the LR schedule; the private
torch APIs used are in `megalite/torch_private.py`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from megalite.dp.grad_sync import GradSync
from megalite.dp.overlap import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, EventSink, OverlapSettings
from megalite.errors import ConfigError
from megalite.optim.muon import ShardMuon
from megalite.optim.muon_math import MuonSettings
from megalite.optim.muon_plan import block_params, build_plan
from megalite.optim.protocol import DistributedOptimizer
from megalite.optim.shard_adamw import ShardAdamW
from megalite.optim.zero import ZeroOptimizer
from megalite.parallel.state import ParallelState


OPTIMIZERS = ("adamw", "muon")  # `train.optimizer`


def build_distributed_optimizer(chunks: nn.Module | Sequence[nn.Module], state: ParallelState, zero: int, lr: float,
                                weight_decay: float, betas: tuple[float, float], eps: float, dtype: torch.dtype,
                                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                                overlap_param_gather: bool = True, zero3_prefetch: int = 1,
                                on_event: EventSink | None = None, optimizer: str = "adamw",
                                muon: MuonSettings = MuonSettings(), fold_weight_grads: bool = True) -> ZeroOptimizer:
    """The optimizer for `parallel.zero` = 0..3 (a `DistributedOptimizer`) over this rank's model chunks
    (a model, or a list / `nn.ModuleList` of the pipeline chunks): a `GradSync` plus `ShardAdamW`, or
    `ShardMuon` (`optimizer="muon"`, with `muon`'s settings; AdamW's for the parameters Muon leaves).

    Converts the model's parameters to `dtype` in place (bf16/fp16 keep fp32 master weights inside the
    optimizer); zero > 0 with dp = 1 falls back to zero = 0 with one warning. The bucket sizes, the
    ZeRO-1/2 parameter-gather overlap and ZeRO-3's prefetch depth only move collectives in time
    (`megalite.dp.overlap`); `on_event` receives an `OverlapEvent` for each launch and wait.
    `lr` is the starting rate; each step is given its own (`step(lr, ...)`). `fold_weight_grads=False`
    (`model.compile`) sends the linears' weight gradients through `.grad` and the hook, not a fold.
    """
    settings = OverlapSettings(bucket_bytes, first_bucket_bytes, overlap_param_gather, zero3_prefetch)
    parts: list[nn.Module] = [chunks] if isinstance(chunks, nn.Module) and not isinstance(chunks, nn.ModuleList) \
        else list(chunks)
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer={optimizer!r} unknown: use {' or '.join(OPTIMIZERS)}")
    sync = GradSync(parts, state, zero, dtype, settings, on_event, fold_weight_grads)
    if optimizer == "muon":
        plan = build_plan(sync.buckets, sync.specs, sync.names(), block_params(parts), state, sync.stage > 0)
        return ZeroOptimizer(sync, ShardMuon(sync.shards(), sync.take_fp32_values(), plan, state, muon,
                                             weight_decay, betas, eps))
    return ZeroOptimizer(sync, ShardAdamW(sync.shards(), sync.take_fp32_values(), weight_decay, betas, eps))


__all__ = ["build_distributed_optimizer", "DistributedOptimizer", "ZeroOptimizer", "ShardAdamW", "ShardMuon",
           "MuonSettings", "OPTIMIZERS"]
