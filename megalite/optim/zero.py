"""The ZeRO optimizer (Rajbhandari et al. 2020, "ZeRO"): a gradient sync and a shard optimizer, composed.

`ZeroOptimizer` is what `pretrain.py` trains with, behind the `DistributedOptimizer` protocol
(`megalite.optim.protocol`) the training step drives. It holds two parts with a typed seam between them:

  `sync`       a `GradSync` (`megalite.dp.grad_sync`): wraps the model; buckets, fp32 main grads,
               reduce / reduce-scatter, parameter all-gathers and their overlap, ZeRO-3 gather/free,
               `no_sync`. It knows nothing of how the parameters are updated.
  `optimizer`  a `ShardOptimizer` (`megalite.dp.shards`; `ShardAdamW` here): math on the `Shard`s the
               sync hands it (fp32 master weights, moments). It never sees a module or a collective.

and does the rest of a step on the shards itself: loss-scale undo, global norm, clipping (`clip`).
Any other `ShardOptimizer` plugs onto the same sync unchanged (tests/test_grad_sync.py: SGD with
momentum at ZeRO 0-3).

Exact bytes held per rank, measured by `memory_bytes()` after a step (Psi = elements of this rank's TP
shard of the model, each shared parameter once; P = Psi padded: sum over buckets of ceil(n_b/N)*N,
P = Psi for stage 0; N = the bucket group's size, dp x cp; b = 4 for fp32, 2 for bf16/fp16):

               params     grads (fp32)   master (fp32)    Adam m, v (fp32)
    stage 0    b Psi      4 Psi          4 Psi or 0       8 Psi
    stage 1    b P        4 P            4 P/N or 0       8 P/N
    stage 2    b P        4 P/N          4 P/N or 0       8 P/N
    stage 3    b P/N      4 P/N          4 P/N or 0       8 P/N

"or 0": in fp32 the params are their own master weights (the master shard is a view of them). So fp32
is (4+4+8) = 16 bytes/element before sharding, bf16 (2+4+4+8) = 18: megalite keeps fp32 gradients
(accumulation over micro-batches in bf16 loses bits), where the ZeRO paper's K=12 formula has 2-byte
gradients. While a stage-2/3 backward runs, a bucket's full fp32 grad buffer exists until it is reduced,
and stage 3 holds the full params of the units being computed (and `parallel.zero3_prefetch` prefetched
units). When each collective runs is `megalite.dp.overlap`'s business; the results do not depend on it.

DP bytes per step (the `CommCounter` convention, M micro-batches):
    stage 0      all-reduce of the fp32 grads:          2 (N-1)/N * 4 Psi   (one all-reduce per bucket)
    stage 1, 2   reduce-scatter fp32 grads + all-gather params:  (N-1)/N * (4 P + b P)
                 (= 2 (N-1)/N * 4 P in fp32: the same volume as DDP, padding included)
    stage 3      all-gather params before each forward and each backward, reduce-scatter grads once:
                 (N-1)/N * (2 M b P + 4 P)   (= 3 (N-1)/N * 4 P in fp32 with M = 1: 1.5x DDP)
The gradient-norm all-reduce over dp (one fp64 scalar) is counted under "norm", not "dp".

zero > 0 with dp = 1 has nothing to shard: it falls back to stage 0 with one warning. ZeRO-3's limits
(one model chunk per rank, no tied embedding across stages) are `zero3.zero3_problems`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megalite.dp import zero_state
from megalite.dp.grad_sync import GradSync
from megalite.dp.shards import ShardOptimizer
from megalite.layers.linear_fn import DeferredWeightGrads
from megalite.optim.clip import clip_grads, global_norm, shard_pieces


class ZeroOptimizer:
    """A `DistributedOptimizer` from a gradient sync and an optimizer over its shards."""

    def __init__(self, sync: GradSync, optimizer: ShardOptimizer) -> None:
        self.sync, self.optimizer = sync, optimizer
        self.shards = sync.shards()

    @property
    def stage(self) -> int:
        """The ZeRO stage (0: nothing sharded over dp); recorded in a checkpoint's layout."""
        return self.sync.stage

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        with self.sync.no_sync():
            yield

    @contextlib.contextmanager
    def defer_weight_grads(self, store: DeferredWeightGrads) -> Iterator[None]:
        """Backward passes inside record the linears' weight-gradient work in `store` (a zero-bubble B)."""
        with self.sync.defer_weight_grads(store):
            yield

    def finish_grad_sync(self) -> None:
        self.sync.finish_grad_sync()

    def scale_grads(self, factor: float) -> None:
        for s in self.shards:
            s.grad.mul_(factor)

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient, each parameter once (`megalite.optim.clip`)."""
        return global_norm(shard_pieces(self.shards, self.sync.state), self.sync.state)

    def step(self, lr: float, clip: float, norm: float) -> None:
        """Clip by the global norm, update this rank's shards, then publish the new params (ZeRO-1/2:
        their all-gathers are launched, and waited on in the next forward unless the overlap is off)."""
        self.sync.finish_param_sync()
        clip_grads([s.grad for s in self.shards], clip, norm)
        self.optimizer.step(lr)
        self.sync.publish_params(wait=False)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers still in flight; call before reading the parameters
        outside a forward."""
        self.sync.finish_param_sync()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every parameter whole and current (ZeRO-3 gathers every unit), e.g. while a checkpoint
        is loaded into them or a sample is generated."""
        with self.sync.gathered():
            yield

    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Checkpoint protocol: global name -> {"master", "exp_avg", "exp_avg_sq", "step"} (see zero_state)."""
        self.sync.finish_param_sync()  # fp32: the master shard is a view of the (being gathered) params
        return zero_state.param_states(self.sync.buckets, self.optimizer.state_shards(), self.sync.names(),
                                       self.stage > 0, self.optimizer.step_count, self.sync.state)

    def load_param_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.sync.finish_param_sync()  # nothing may still be writing the parameters we overwrite
        shards, step = zero_state.load_param_states(self.sync.buckets, self.sync.names(), states,
                                                    self.optimizer.state_kinds)
        self.optimizer.load_state_shards(shards, step)
        self.sync.publish_params()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered over dp (still TP-sharded), by name; for tests and checkpoints."""
        self.sync.finish_param_sync()
        return zero_state.full_parameters(self.sync.buckets, self.sync.names(), self.stage == 3, self.sync.state)

    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds now, by kind (from the tensors; see the table in the module doc)."""
        return {**self.sync.memory_bytes(), **self.optimizer.memory_bytes()}
