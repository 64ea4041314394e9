"""`build_distributed_optimizer`: a `megalite.dp.GradSync` composed with `ShardAdamW` or `ShardMuon`.

It lives in `optim`, not in `megalite.dp`, because a composition must import both parts: the sync sits below
the optimizers and never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from megalite.dp.grad_sync import GradSync
from megalite.dp.overlap import EventSink, OverlapSettings
from megalite.errors import ConfigError
from megalite.optim.config import OPTIMIZERS, MuonConfig, OptimizerConfig
from megalite.optim.muon import ShardMuon
from megalite.optim.muon_plan import block_params, build_plan
from megalite.optim.shard_adamw import ShardAdamW
from megalite.optim.zero import ZeroOptimizer
from megalite.parallel.state import ParallelState


@dataclass(frozen=True)
class SyncOptions:
    """How the gradient sync under the optimizer runs; results are identical for every choice.

    `overlap`: bucket sizes, the ZeRO-1/2 parameter-gather overlap and ZeRO-3's prefetch depth, which only move
    collectives in time (`megalite.dp.overlap`); `on_event` receives an `OverlapEvent` for each launch and wait;
    `fold_weight_grads=False` (`model.compile`) sends the linears' weight gradients through `.grad` and the
    hook, not a fold."""

    overlap: OverlapSettings = field(default_factory=OverlapSettings)
    fold_weight_grads: bool = True
    on_event: EventSink | None = None


def build_distributed_optimizer(chunks: nn.Module | Sequence[nn.Module], state: ParallelState, zero: int,
                                dtype: torch.dtype, optimizer: OptimizerConfig = OptimizerConfig(),
                                muon: MuonConfig = MuonConfig(), sync: SyncOptions = SyncOptions()) -> ZeroOptimizer:
    """The optimizer for `parallel.zero` = 0..3 (a `DistributedOptimizer`) over this rank's model chunks
    (a model, or a list / `nn.ModuleList` of the pipeline chunks): a `GradSync` plus `ShardAdamW`, or
    `ShardMuon` (`optimizer.name="muon"`, with `muon`'s settings; AdamW's for the parameters Muon leaves).

    Converts the model's parameters to `dtype` in place (bf16/fp16 keep fp32 master weights inside the
    optimizer); zero > 0 with dp = 1 falls back to zero = 0 with one warning. The learning rate is given to
    each step (`step(lr, ...)`).
    """
    parts: list[nn.Module] = [chunks] if isinstance(chunks, nn.Module) and not isinstance(chunks, nn.ModuleList) \
        else list(chunks)
    if optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={optimizer.name!r} unknown: use {' or '.join(OPTIMIZERS)}")
    grad_sync = GradSync(parts, state, zero, dtype, sync.overlap, sync.on_event, sync.fold_weight_grads)
    betas, eps = optimizer.betas, optimizer.adam_eps
    if optimizer.name == "muon":
        plan = build_plan(grad_sync.buckets, grad_sync.specs, grad_sync.names(), block_params(parts), state,
                          grad_sync.stage > 0)
        return ZeroOptimizer(grad_sync, ShardMuon(grad_sync.shards(), grad_sync.take_fp32_values(), plan, state, muon,
                                                  optimizer.weight_decay, betas, eps))
    return ZeroOptimizer(grad_sync, ShardAdamW(grad_sync.shards(), grad_sync.take_fp32_values(),
                                               optimizer.weight_decay, betas, eps))
