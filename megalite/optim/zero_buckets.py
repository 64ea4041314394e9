"""Flat buffers for the ZeRO optimizer: buckets, their per-rank shards, and AdamW on a flat shard.

A bucket is a group of parameters laid end to end in one flat buffer (Megatron's `ParamAndGradBuffer`,
PyTorch DDP's bucket, FSDP's `FlatParameter`). For ZeRO stages >= 1 its length is padded up to a
multiple of dp and rank r owns the contiguous range [r*L/dp, (r+1)*L/dp) of it: one reduce-scatter
(grads) and one all-gather (params) per bucket, no per-parameter collectives. A rank's shard can cut
a parameter in two; the `Segment`s record which pieces of which parameters it holds, so weight decay,
the "count TP-replicated parameters once" rule of the gradient norm and the SP-partial TP reduction
can be applied per piece without a per-element mask tensor (which would cost memory the ZeRO
formulas do not have).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.parallel.param_spec import ParamSpec, Tied
from megalite.parallel.state import GroupKind


@dataclass(frozen=True)
class Segment:
    """A piece [lo, hi) of this rank's shard that belongs to one parameter."""

    lo: int
    hi: int
    decay: bool       # AdamW weight decay applies (matrices only, like `build_optimizer`)
    replicated: bool  # same values on every TP rank (a replicated `TPLayout`): counted once in the norm
    sp_partial: bool  # grads are partial sums over TP under sequence parallelism
    copy: bool = False  # the last pipeline stage's copy of a tied embedding: not counted in the norm


@dataclass(eq=False)
class Bucket:
    """Parameters `params` at `offsets` in a flat buffer of `padded` elements; this rank owns [lo, hi)."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    lo: int
    hi: int
    segments: list[Segment]
    param_flat: torch.Tensor                # model params (param dtype), [padded]; views of it are the params
    param_shard: torch.Tensor | None        # stage 3 only: the persistent 1/dp of `param_flat`
    master: torch.Tensor                    # fp32 [hi - lo] (a view of the params when they are fp32)
    exp_avg: torch.Tensor                   # fp32 [hi - lo]
    exp_avg_sq: torch.Tensor                # fp32 [hi - lo]
    grad_shard: torch.Tensor | None = None  # fp32 [hi - lo]: the reduced gradient this rank owns
    grad_flat: torch.Tensor | None = None   # fp32 [padded]: local accumulation (main_grad)
    n_grads: int = 0                        # parameters that receive a gradient each backward
    ready: int = 0                          # of those, how many arrived in the current backward
    launched: bool = False                  # the DP reduction of this step has been started
    work: dist.Work | None = None
    scatter_out: torch.Tensor | None = None  # reduce-scatter destination while in flight
    gather_work: dist.Work | None = None     # stage 3: pending parameter all-gather
    index: dict[int, int] = field(default_factory=dict)  # id(param) -> position in `params`
    group: GroupKind = "dp_cp"               # the ParamSpec.grad_group of every parameter in it

    @property
    def shard_numel(self) -> int:
        return self.hi - self.lo


def make_bucket(params: list[nn.Parameter], specs: Mapping[nn.Parameter, ParamSpec], dp: int, dp_rank: int,
                pad: bool, group: GroupKind = "dp_cp") -> tuple[Bucket, torch.Tensor]:
    """Lay `params` out flat; returns the bucket (buffers not yet allocated) and the fp32 full values."""
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
    empty = torch.empty(0)
    bucket = Bucket(params=params, offsets=offsets, numel=total, padded=padded, lo=lo, hi=hi, segments=segments,
                    param_flat=empty, param_shard=None, master=empty, exp_avg=empty, exp_avg_sq=empty,
                    n_grads=sum(p.requires_grad for p in params),
                    index={id(p): i for i, p in enumerate(params)}, group=group)
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


ADAMW_CHUNK = 1 << 16  # fallback loop: elements per chunk (4 fp32 tensors x 256 KiB stay in a 1-2 MiB L2)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel (torch >= 2.4)


@torch.no_grad()
def adamw_flat(b: Bucket, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
               step: int) -> None:
    """AdamW (Loshchilov & Hutter 2019) on this rank's flat shard, decay on matrices only.

    torch's fused kernel (the one `torch.optim.AdamW(fused=True)` and Hugging Face's Trainer use):
    one pass over memory for the whole update, two calls per bucket (the decayed pieces, the rest)
    instead of seven elementwise ops per tensor. It is elementwise and its result does not depend on
    an element's position in the buffer, so a sharded update equals the replicated one to the last bit
    (tests/test_zero.py). It differs from the unfused `foreach=False` arithmetic by at most an ulp on a
    few elements (fused multiply-adds). Padding elements belong to no segment and are never touched.
    """
    assert b.grad_shard is not None
    if b.master.device.type not in FUSED_ADAMW_DEVICES:
        adamw_flat_unfused(b, lr, weight_decay, betas, eps, step)
        return
    step_t = torch.tensor(float(step), dtype=torch.float32, device=b.master.device)
    for decay in (True, False):
        segs = [s for s in b.segments if (s.decay and weight_decay != 0.0) == decay]
        if not segs:
            continue
        pieces = [[t[s.lo:s.hi] for s in segs] for t in (b.master, b.grad_shard, b.exp_avg, b.exp_avg_sq)]
        torch._fused_adamw_(*pieces, [], [step_t] * len(segs), lr=lr, beta1=betas[0], beta2=betas[1],
                            weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False,
                            maximize=False)


@torch.no_grad()
def adamw_flat_unfused(b: Bucket, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                       step: int) -> None:
    """The same update as `torch.optim.AdamW(foreach=False)`, op by op (devices without a fused kernel).

    Padding elements have zero gradient and zero moments, so their update is 0 / (0 + eps) = 0.
    """
    assert b.grad_shard is not None
    beta1, beta2 = betas
    if weight_decay != 0.0:
        for s in b.segments:
            if s.decay:
                b.master[s.lo:s.hi].mul_(1 - lr * weight_decay)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    # Walk the shard in cache-sized chunks: each chunk's m, v, grad and params stay in cache through the
    # whole update instead of streaming every multi-MB buffer through memory once per operation
    # (elementwise ops, so the result is bit-identical to one pass over the whole shard).
    n = b.shard_numel
    for lo in range(0, n, ADAMW_CHUNK):
        hi = min(n, lo + ADAMW_CHUNK)
        g, m, v, w = b.grad_shard[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], b.master[lo:hi]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-(lr / bias_correction1))


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of storage a tensor holds (0 for None or a freed stage-3 buffer)."""
    return 0 if t is None else t.untyped_storage().nbytes()
