"""The typed hand-off between the gradient sync and the optimizer: the shards a rank updates.

The gradient sync (`megalite.dp.grad_sync`) owns the model's parameters and gradients in flat buckets
and reduces them; after `finish_grad_sync()` it hands each bucket's *own* range to the optimizer as a
`Shard`: the parameter elements this rank updates (model dtype, written back by the optimizer's step),
the fp32 reduced gradient of exactly those elements, and the `Segment`s saying which pieces of which
parameters the range holds. The optimizer (`ShardOptimizer`, e.g. `megalite.optim.shard_adamw`) is only
math on these: it never sees a module, a hook or a collective. At ZeRO 0 the range is the whole bucket,
at ZeRO >= 1 it is 1/N of it (N = the size of the bucket's `group`).

Loss scaling, the global gradient norm and clipping are the optimizer's math on the same shards
(`megalite.optim.zero`, `megalite.optim.clip`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megalite.parallel.param_spec import GradReduction
from megalite.parallel.state import GroupKind


@dataclass(frozen=True)
class Segment:
    """A piece [lo, hi) of a shard that belongs to one parameter."""

    lo: int
    hi: int
    decay: bool       # AdamW weight decay applies (matrices only, as `reference.adamw_with_groups`)
    replicated: bool  # same values on every TP rank (a replicated `TPLayout`): counted once in the norm
    sp_partial: bool  # grads are partial sums over TP under sequence parallelism
    copy: bool = False  # the last pipeline stage's copy of a tied embedding: not counted in the norm


@dataclass(frozen=True, eq=False)
class Shard:
    """One bucket's range that this rank updates. The tensors stay the same objects for the whole run
    (the sync allocates them once), so an optimizer may keep per-shard state aligned with them."""

    params: torch.Tensor            # [n] this rank's elements of the parameters, model dtype
    grad: torch.Tensor              # [n] fp32: the reduced gradient of those elements
    segments: tuple[Segment, ...]   # which parameter pieces the range holds (padding belongs to none)
    grads: GradReduction            # how the bucket's gradient was reduced (over `grads.group`)
    sharded: bool                   # the range is 1/N of the bucket (ZeRO >= 1), not all of it

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def group(self) -> GroupKind:
        """The ranks the bucket's gradient was summed over (and, ZeRO >= 1, sharded over)."""
        return self.grads.group

    @property
    def norm_group(self) -> GroupKind | None:
        """The ranks whose squared norms of this shard's kind add up (`GradReduction.norm_group`)."""
        return self.grads.norm_group(self.sharded)


@runtime_checkable
class ShardOptimizer(Protocol):
    """An optimizer over `Shard`s: keeps its state (fp32 master weights, moments) per shard, updates the
    shards' `params` in `step`. Its state is checkpointed per parameter by `megalite.dp.zero_state`
    from `state_shards()` (fp32 tensors aligned with each shard) and restored by `load_state_shards`."""

    step_count: int
    state_kinds: tuple[str, ...]  # the names of its per-shard fp32 state tensors, "master" first

    def step(self, lr: float) -> None:
        """One update of every shard from its `grad`, written into its `params` (cast to their dtype)."""
        ...

    def state_shards(self) -> list[dict[str, torch.Tensor]]:
        """Per shard, the fp32 state tensors to save, each [numel], among `state_kinds` ("master" always)."""
        ...

    def load_state_shards(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Restore every kind of `state_kinds` per shard (zeros where a checkpoint had none: that state
        starts fresh) and write the masters into the shards' `params`."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of state held: {"master": ..., "optimizer": ...}."""
        ...

