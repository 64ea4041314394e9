"""Optimizers: AdamW, the LR schedule, and the ZeRO optimizer behind the `DistributedOptimizer` protocol.

`protocol.py` is the contract (what the training step, the pipeline engine and the checkpoints call);
`zero.py` (+ `zero_buckets`, `zero3`, `zero_state`) is what runs, `overlap.py` when its collectives
run; `reference.py` is the replicated oracle the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.optim.overlap import (DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, EventSink, OverlapEvent,
                                    OverlapSettings, mib_to_bytes)
from megalite.optim.protocol import DistributedOptimizer
from megalite.optim.zero import ZeroOptimizer
from megalite.parallel.state import ParallelState


def build_distributed_optimizer(model: nn.Module, state: ParallelState, zero: int, lr: float, weight_decay: float,
                                betas: tuple[float, float], eps: float, dtype: torch.dtype,
                                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                                overlap_param_gather: bool = True, zero3_prefetch: int = 1,
                                on_event: EventSink | None = None) -> ZeroOptimizer:
    """The optimizer for `parallel.zero` = 0..3 (a `DistributedOptimizer`).

    Converts the model's parameters to `dtype` in place (bf16/fp16 keep fp32 master weights inside the
    optimizer); zero > 0 with dp = 1 falls back to zero = 0 with one warning. The bucket sizes, the
    ZeRO-1/2 parameter-gather overlap and ZeRO-3's prefetch depth only move collectives in time
    (`megalite.optim.overlap`); `on_event` receives an `OverlapEvent` for each launch and wait.
    """
    settings = OverlapSettings(bucket_bytes, first_bucket_bytes, overlap_param_gather, zero3_prefetch)
    return ZeroOptimizer(model, state, zero, lr, weight_decay, betas, eps, dtype, settings, on_event)


__all__ = ["build_distributed_optimizer", "DistributedOptimizer", "ZeroOptimizer", "OverlapSettings",
           "OverlapEvent", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "mib_to_bytes"]
