"""Data parallelism: the gradient sync that wraps the model, and ZeRO stages 0-3 (Rajbhandari et al. 2020).

Megatron-core keeps this apart from its optimizers (`core/distributed/` beside `core/optimizer/`), torchtitan
keeps FSDP under `distributed/`; here it sits below `megalite.optim`, which imports it and is never imported
by it. `grad_sync.py` (`GradSync`) lays the parameters out in flat buckets (`buckets.py`), keeps fp32 main
grads, reduces them over each parameter's `ParamSpec` group and gathers the parameters back; `overlap.py`
says when those collectives run, `zero3.py` gathers and frees ZeRO-3's units, `zero_state.py` turns the
bucketed state into per-parameter tensors for checkpoints. What it hands an optimizer is `shards.py`
(`Shard`, `ShardOptimizer`): the seam; the optimizer maths on it lives in `megalite.optim`.
`reduce_grads.py` is the plain, unbucketed reduction over `.grad` tensors the reference optimizer uses.
"""

from __future__ import annotations

from megalite.dp.grad_sync import GradSync
from megalite.dp.overlap import (DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, EventSink, OverlapEvent,
                                 OverlapSettings, mib_to_bytes)
from megalite.dp.shards import Segment, Shard, ShardOptimizer

__all__ = ["GradSync", "OverlapSettings", "OverlapEvent", "EventSink", "DEFAULT_BUCKET_BYTES",
           "DEFAULT_FIRST_BUCKET_BYTES", "mib_to_bytes", "Shard", "Segment", "ShardOptimizer"]
