"""Flat buffers for the gradient sync: buckets and their per-rank shards.

A bucket is a group of parameters laid end to end in one flat buffer (Megatron's `ParamAndGradBuffer`,
PyTorch DDP's bucket, FSDP's `FlatParameter`). For ZeRO stages >= 1 its length is padded up to a
multiple of dp and rank r owns the contiguous range [r*L/dp, (r+1)*L/dp) of it: one reduce-scatter
(grads) and one all-gather (params) per bucket, no per-parameter collectives. A rank's shard can cut
a parameter in two; the `Segment`s (`megalite.dp.shards`) record which pieces of which parameters
it holds, so weight decay, the "count TP-replicated parameters once" rule of the gradient norm and the
SP-partial TP reduction can be applied per piece without a per-element mask tensor (which would cost memory the ZeRO
formulas do not have). A bucket's parameters share one reduction group (`ParamSpec.grad_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.dp.shards import Segment, Shard
from megalite.parallel.param_spec import GradReduction, ParamSpec, Tied
from megalite.parallel.state import GroupKind


@dataclass(eq=False)
class Bucket:
    """Parameters `params` at `offsets` in a flat buffer of `padded` elements; this rank owns [lo, hi) of
    the `group` ranks' shards."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    lo: int
    hi: int
    segments: list[Segment]
    grads: GradReduction                    # how its gradient is reduced (`grads.group`: averaged, sharded over)
    param_flat: torch.Tensor                # model params (param dtype), [padded]; views of it are the params
    param_shard: torch.Tensor | None        # stage 3 only: the persistent 1/dp of `param_flat`
    grad_shard: torch.Tensor | None = None  # fp32 [hi - lo]: the reduced gradient this rank owns
    grad_flat: torch.Tensor | None = None   # fp32 [padded]: local accumulation (main_grad)
    n_grads: int = 0                        # parameters that receive a gradient each backward
    ready: int = 0                          # of those, how many arrived since the step's sync pass began
    unit_ready: int = 0                     # stage 3: how many arrived since the unit was last gathered
    launched: bool = False                  # the DP reduction of this step has been started
    work: dist.Work | None = None
    scatter_out: torch.Tensor | None = None  # reduce-scatter destination while in flight
    gather_work: dist.Work | None = None     # stage 3: pending parameter all-gather
    index: dict[int, int] = field(default_factory=dict)  # id(param) -> position in `params`

    @property
    def group(self) -> GroupKind:
        """The ranks its gradient is summed over (and, ZeRO >= 1, sharded over)."""
        return self.grads.group

    @property
    def shard_numel(self) -> int:
        return self.hi - self.lo

    def own_params(self) -> torch.Tensor:
        """This rank's range of the parameters (stage 3: the persistent shard)."""
        return self.param_shard if self.param_shard is not None else self.param_flat[self.lo:self.hi]

    def shard(self, sharded: bool) -> Shard:
        """What the optimizer updates of this bucket (the buffers must exist: see `GradSync`)."""
        assert self.grad_shard is not None
        return Shard(self.own_params(), self.grad_shard, tuple(self.segments), self.grads, sharded)


def make_bucket(params: list[nn.Parameter], specs: Mapping[nn.Parameter, ParamSpec], dp: int, dp_rank: int,
                pad: bool) -> tuple[Bucket, torch.Tensor]:
    """Lay `params` (of one `grad_group`, of `dp` ranks of which this is `dp_rank`) out flat; returns the
    bucket (buffers not yet allocated) and the fp32 full values."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = -(-total // dp) * dp if pad else total
    size = padded // dp if pad else padded
    lo, hi = (dp_rank * size, (dp_rank + 1) * size) if pad else (0, padded)
    full32 = torch.zeros(padded, dtype=torch.float32, device=params[0].device)
    segments = []
    for p, off in zip(params, offsets):
        full32[off:off + p.numel()] = p.detach().reshape(-1).float()
        a, b = max(off, lo), min(off + p.numel(), hi)
        if a < b:
            spec = specs[p]
            segments.append(Segment(a - lo, b - lo, p.dim() >= 2, not spec.layout.split, spec.sp_partial,
                                    spec.tied is Tied.HEAD_COPY))
    groups = {specs[p].grads for p in params}
    assert len(groups) == 1, f"a bucket mixes gradient reductions {groups}"
    bucket = Bucket(params=params, offsets=offsets, numel=total, padded=padded, lo=lo, hi=hi, segments=segments,
                    grads=groups.pop(), param_flat=torch.empty(0), param_shard=None,
                    n_grads=sum(p.requires_grad for p in params),
                    index={id(p): i for i, p in enumerate(params)})
    return bucket, full32


def split_by_size(params: list[nn.Parameter], bucket_bytes: int,
                  first_bucket_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most `bucket_bytes` of fp32 gradient (a larger parameter is alone); the
    first group holds at most `first_bucket_bytes` (when smaller than `bucket_bytes`).

    `params` come in the order their gradients become ready (the output layer first), so a small first
    bucket is complete, and its reduction starts, while most of the backward is still ahead (PyTorch
    DDP caps its first bucket at 1 MiB for this reason); the later, larger buckets amortise each
    collective's fixed latency.
    """
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    limit = min(bucket_bytes, first_bucket_bytes or bucket_bytes)
    for p in params:
        nbytes = p.numel() * 4
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size, limit = 0, bucket_bytes
        groups[-1].append(p)
        size += nbytes
    return [g for g in groups if g]


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of storage a tensor holds (0 for None or a freed stage-3 buffer)."""
    return 0 if t is None else t.untyped_storage().nbytes()
