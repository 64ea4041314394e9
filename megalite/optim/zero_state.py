"""The checkpoint protocol of the ZeRO optimizer: per-parameter fp32 master weights and Adam moments.

`megalite.checkpoint.sharded` saves and loads logical tensors by global parameter name, whatever the
layout; the ZeRO optimizer keeps them in flat buckets of which each rank owns 1/dp. So saving gathers
a bucket's shards over dp (counted under "checkpoint", not "dp", so step traffic stays exact) and cuts
it into parameters; loading rebuilds each bucket's flat fp32 buffers from the per-parameter tensors
and keeps this rank's range. Every rank then holds the same dict (only dp rank r's share is written).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from megalite.optim.zero_buckets import Bucket
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Names = Mapping[int, str]  # id(parameter) -> its name in the model


def _global_name(name: str) -> str:
    return re.sub(r"^\d+\.", "", name, count=1)  # drop an nn.ModuleList chunk prefix


def _full(b: Bucket, shard: torch.Tensor, sharded: bool, state: ParallelState) -> torch.Tensor:
    if not sharded:
        return shard
    full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
    work = comm.all_gather_async(full, shard.contiguous(), state, b.group, count_as="checkpoint")
    if work is not None:
        work.wait()
    return full


@torch.no_grad()
def param_states(buckets: list[Bucket], names: Names, sharded: bool, step: int,
                 state: ParallelState) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and (after the first `step`) Adam moments, whole over dp; `sharded`:
    the buckets hold 1/dp each (ZeRO stage >= 1)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for b in buckets:
        master = _full(b, b.master.float(), sharded, state)
        moments = (_full(b, b.exp_avg, sharded, state), _full(b, b.exp_avg_sq, sharded, state)) if step > 0 else None
        for p, off in zip(b.params, b.offsets):
            sl = slice(off, off + p.numel())
            entry = {"master": master[sl].view(p.shape).clone()}
            if moments is not None:
                entry["exp_avg"] = moments[0][sl].view(p.shape).clone()
                entry["exp_avg_sq"] = moments[1][sl].view(p.shape).clone()
                entry["step"] = torch.tensor(float(step))
            out[_global_name(names[id(p)])] = entry
    return out


@torch.no_grad()
def load_param_states(buckets: list[Bucket], names: Names, states: dict[str, dict[str, torch.Tensor]]) -> int:
    """Fill each bucket's master and Adam shards from per-parameter tensors; returns the optimizer step
    (0 when the states have none). The caller publishes the new master weights into the model."""
    steps = {int(e["step"]) for e in states.values() if "step" in e}
    for b in buckets:
        flats = {k: torch.zeros(b.padded, dtype=torch.float32, device=b.exp_avg.device)
                 for k in ("master", "exp_avg", "exp_avg_sq")}
        for p, off in zip(b.params, b.offsets):
            entry = states.get(_global_name(names[id(p)]), {})
            for kind, flat in flats.items():
                if kind in entry:
                    flat[off:off + p.numel()] = entry[kind].reshape(-1).to(flat.device, torch.float32)
        b.master.copy_(flats["master"][b.lo:b.hi])
        b.exp_avg.copy_(flats["exp_avg"][b.lo:b.hi])  # zeros for parameters that start fresh
        b.exp_avg_sq.copy_(flats["exp_avg_sq"][b.lo:b.hi])
    return max(steps) if steps else 0


@torch.no_grad()
def full_parameters(buckets: list[Bucket], names: Names, sharded_params: bool,
                    state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter, whole over dp, by its model name; `sharded_params`: ZeRO-3, where each rank
    keeps only its 1/(dp·cp) (`param_shard`), gathered here (counted under "dp", the dp x cp group's traffic)."""
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        if sharded_params:
            assert b.param_shard is not None
            full = torch.empty(b.padded, dtype=b.param_flat.dtype, device=b.param_shard.device)
            work = comm.all_gather_async(full, b.param_shard, state, b.group)
            if work is not None:
                work.wait()
        else:
            full = b.param_flat
        for p, off in zip(b.params, b.offsets):
            out[names[id(p)]] = full[off:off + p.numel()].view(p.shape).clone()
    return out
