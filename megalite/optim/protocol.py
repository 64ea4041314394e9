"""The optimizer's typed contracts: what the rest of megalite calls on it, and what it needs from the model.

`DistributedOptimizer` is everything the training step (`megalite.training`) and the checkpoint code
(`megalite.checkpoint.sharded`) use of an optimizer; the pipeline engine needs only its backward-side
part (`megalite.pipeline.engine.BackwardSync`: `no_sync`, `defer_weight_grads`). Two classes implement
it: `ZeroOptimizer` (`megalite.optim.zero`, a `GradSync` and AdamW on its shards at ZeRO stages 0-3:
what `pretrain.py` runs) and `ReferenceOptimizer` (`megalite.optim.reference`, replicated
`torch.optim.AdamW`: the oracle the tests compare against). tests/test_optim_protocol.py checks that
both have every member with the same signature. Between the gradient sync and the optimizer math the
contract is `megalite.dp.shards` (`Shard`, `ShardOptimizer`).

What the gradient sync asks of the model (the other way round) is in `megalite.dp.grad_sync`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, runtime_checkable

import torch

from megalite.layers.linear_fn import DeferredWeightGrads


@runtime_checkable
class DistributedOptimizer(Protocol):
    """One optimizer step, as `train_step` drives it:

        zero_grad()
        forward/backward over the micro-batches, every backward but each chunk's last inside no_sync()
                                  (a split last backward: its B and its W outside; B inside
                                  defer_weight_grads(store), W = store.run())
        finish_grad_sync()        gradients reduced over dp exactly once per step (and SP / tied sums)
        scale_grads(1 / scale)    undo the loss scale (fp16)
        norm = grad_norm()        the global norm, each parameter once; the same on every rank
        step(lr, clip, norm)      clip by `norm`, AdamW, publish the new parameters (the publishing
                                  may still be in flight: the next forward waits for it)

    and around the loop: `finish_param_sync()` before reading the parameters outside a forward,
    `gathered()` while a checkpoint is loaded into the model, `param_states()` / `load_param_states()`
    for the sharded checkpoint, `memory_bytes()` for the log.
    """

    @property
    def stage(self) -> int:
        """The ZeRO stage (0: nothing sharded over dp); recorded in a checkpoint's layout."""
        ...

    def zero_grad(self) -> None: ...

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        ...

    @contextlib.contextmanager
    def defer_weight_grads(self, store: DeferredWeightGrads) -> Iterator[None]:
        """Backward passes inside record the linears' weight-gradient work in `store` for a later W."""
        ...

    def finish_grad_sync(self) -> None: ...

    def scale_grads(self, factor: float) -> None: ...

    def grad_norm(self) -> float: ...

    def step(self, lr: float, clip: float, norm: float) -> None: ...

    def finish_param_sync(self) -> None:
        """Wait until every parameter is whole and current: `step` may leave parameter all-gathers in
        flight (ZeRO-1/2 overlaps them with the next forward, whose modules wait for theirs). Anything
        that reads the parameters outside a forward (checkpoint save, generation, export) calls this first."""
        ...

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every parameter whole (ZeRO-3 gathers them), e.g. while a checkpoint is loaded into them."""
        ...

    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Global parameter name -> {"exp_avg", "exp_avg_sq" (local TP shard, fp32), "step", optionally
        "master" (the fp32 parameter)}; parameters without Adam state yet have no "exp_avg"."""
        ...

    def load_param_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """The inverse of `param_states`; an entry without "exp_avg" starts that parameter fresh."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds by kind ("params", "grads", "master", "optimizer")."""
        ...

