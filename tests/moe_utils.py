"""Helpers for the MoE tests: a tiny MoE config and expert-parallel layouts inside `DistWorld` ranks."""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from megalite.moe.config import MoEConfig
from megalite.parallel.counter import CommCounter
from megalite.parallel.state import ParallelState, create_groups
from tests.parallel_utils import tiny_model_cfg

_GROUPS: dict[tuple[int, ...], ParallelState] = {}  # per worker process: groups are expensive


def moe_layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False) -> ParallelState:
    """This rank's ParallelState with expert parallelism (groups created once per layout per worker)."""
    world = dist.get_world_size()
    dp = world // (tp * cp * pp)
    key = (tp, pp, dp, cp, ep)
    if key not in _GROUPS:
        state = ParallelState(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), cp=cp, ep=ep)
        create_groups(state)
        _GROUPS[key] = state
    return replace(_GROUPS[key], sp=sp, counter=CommCounter())


MOE_DEFAULTS = dict(experts=4, top_k=2, ffn_hidden_size=32, shared_experts=0, shared_ffn_hidden_size=0,
                    first_dense=0, every=1, router="qwen3", renorm=True, route_scale=1.0, groups=1, group_top_k=1,
                    bias_rate=0.0, aux_loss=0.01, z_loss=0.001, capacity_factor=None)


def tiny_moe_cfg(arch: str = "llama", **overrides: object):
    """tests.parallel_utils' tiny model with every MoE layer routed over 4 experts (top-2); an override
    `moe_X=v` sets the `[moe]` section's `X`, the others the model's fields."""
    moe = {**MOE_DEFAULTS, **{k.removeprefix("moe_"): v for k, v in overrides.items() if k.startswith("moe_")}}
    rest = {k: v for k, v in overrides.items() if not k.startswith("moe_")}
    return tiny_model_cfg(arch, **rest, moe=MoEConfig(**moe))  # type: ignore[arg-type]
