"""Optimizers: AdamW, the LR schedule, and the ZeRO optimizer behind the `DistributedOptimizer` protocol.

`protocol.py` is the contract (what the training step, the pipeline engine and the checkpoints call);
`zero.py` (+ `zero_buckets`, `zero3`, `zero_state`) is what runs; `reference.py` is the replicated
oracle the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.optim.protocol import DistributedOptimizer
from megalite.optim.zero import DEFAULT_BUCKET_BYTES, ZeroOptimizer
from megalite.parallel.state import ParallelState


def build_distributed_optimizer(model: nn.Module, state: ParallelState, zero: int, lr: float, weight_decay: float,
                                betas: tuple[float, float], eps: float, dtype: torch.dtype,
                                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ZeroOptimizer:
    """The optimizer for `parallel.zero` = 0..3 (a `DistributedOptimizer`).

    Converts the model's parameters to `dtype` in place (bf16/fp16 keep fp32 master weights inside the
    optimizer); zero > 0 with dp = 1 falls back to zero = 0 with one warning.
    """
    return ZeroOptimizer(model, state, zero, lr, weight_decay, betas, eps, dtype, bucket_bytes)


__all__ = ["build_distributed_optimizer", "DistributedOptimizer", "ZeroOptimizer", "DEFAULT_BUCKET_BYTES"]
