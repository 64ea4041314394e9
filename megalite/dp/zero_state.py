"""The checkpoint protocol of the ZeRO optimizer: per-parameter fp32 master weights and optimizer states.

`megalite.checkpoint.sharded` saves and loads logical tensors by global parameter name, whatever the
layout; the gradient sync keeps parameters in flat buckets of which each rank's optimizer owns 1/N. So
saving gathers each of a bucket's state shards over the bucket's group (counted under "checkpoint", not
"dp", so step traffic stays exact) and cuts it into parameters; loading rebuilds each bucket's flat fp32
buffers from the per-parameter tensors and keeps this rank's range. Every rank then holds the same dict
(only dp rank r's share is written). The kinds of state ("master", "exp_avg", ...) are the optimizer's.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from megalite.dp.buckets import Bucket
from megalite.parallel import comm
from megalite.parallel.param_spec import logical_name
from megalite.parallel.state import ParallelState

Names = Mapping[int, str]  # id(parameter) -> its name in the model
States = dict[str, dict[str, torch.Tensor]]


def _full(b: Bucket, shard: torch.Tensor, sharded: bool, state: ParallelState) -> torch.Tensor:
    if not sharded:
        return shard
    full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
    work = comm.all_gather_async(full, shard.contiguous(), state, b.group, count_as="checkpoint")
    if work is not None:
        work.wait()
    return full


@torch.no_grad()
def param_states(buckets: Sequence[Bucket], shard_states: Sequence[Mapping[str, torch.Tensor]], names: Names,
                 sharded: bool, step: int, state: ParallelState) -> States:
    """Every parameter's optimizer state (`shard_states[i]`: bucket i's own range of each kind), whole over
    the bucket's group, plus "step" once a step was taken; `sharded`: the buckets hold 1/N each (ZeRO >= 1)."""
    out: States = {}
    for b, kinds in zip(buckets, shard_states):
        fulls = {kind: _full(b, t, sharded, state) for kind, t in kinds.items()}
        for p, off in zip(b.params, b.offsets):
            sl = slice(off, off + p.numel())
            entry = {kind: full[sl].view(p.shape).clone() for kind, full in fulls.items()}
            if step > 0:
                entry["step"] = torch.tensor(float(step))
            out[logical_name(names[id(p)])] = entry
    return out


@torch.no_grad()
def load_param_states(buckets: Sequence[Bucket], names: Names, states: States,
                      kinds: Sequence[str]) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Each bucket's own range of every state kind, from per-parameter tensors (zeros for a parameter or
    kind the states lack), and the optimizer step (0 when the states have none)."""
    steps = {int(e["step"]) for e in states.values() if "step" in e}
    out = []
    for b in buckets:
        device = b.grad_shard.device if b.grad_shard is not None else b.param_flat.device
        flats = {k: torch.zeros(b.padded, dtype=torch.float32, device=device) for k in kinds}
        for p, off in zip(b.params, b.offsets):
            entry = states.get(logical_name(names[id(p)]), {})
            for kind, flat in flats.items():
                if kind in entry:
                    flat[off:off + p.numel()] = entry[kind].reshape(-1).to(flat.device, torch.float32)
        out.append({k: flat[b.lo:b.hi] for k, flat in flats.items()})
    return out, (max(steps) if steps else 0)


@torch.no_grad()
def full_parameters(buckets: Sequence[Bucket], names: Names, sharded_params: bool,
                    state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter, whole over its group, by its model name; `sharded_params`: ZeRO-3, where each rank
    keeps only its 1/N (`param_shard`), gathered here (counted under the group's key, "dp" for dp x cp)."""
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
