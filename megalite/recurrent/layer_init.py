"""What the recurrent layers (Gated DeltaNet, Mamba2) share in building their weights: each drawn whole from
(seed, name) and then cut to this rank's heads, so every tensor-parallel layout starts from the same numbers.

The decay's parameters follow Mamba2 (Dao & Gu 2024, as Megatron-core's GDN): A ~ U(1, 16) stored as A_log, and
the step dt log-uniform in [1e-3, 1e-1] stored as softplus^-1(dt) in dt_bias, so that softplus(a + dt_bias)
starts at dt for a = 0. The depthwise conv takes nn.Conv1d's default bound U(-1/sqrt(W), 1/sqrt(W)).
"""

from __future__ import annotations

import math

import torch

from megalite.layers.init import name_seed

Tensor = torch.Tensor


def seeded_uniform(shape: tuple[int, ...], seed: int, name: str) -> Tensor:
    """U(0, 1) of `shape`, drawn whole from (seed, name): the same numbers at every layout."""
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.rand(shape, generator=gen, dtype=torch.float32)


def shard_parts(full: Tensor, parts: list[int], tp: int, rank: int) -> Tensor:
    """Rank `rank`'s rows of each logical part of `full` (dim 0), concatenated: the column layout's shard."""
    return torch.cat([p.chunk(tp, dim=0)[rank] for p in full.split(parts, dim=0)], dim=0).contiguous()


def conv_init(shape: tuple[int, ...], width: int, seed: int, name: str) -> Tensor:
    """A depthwise conv's weight [C, W] or bias [C], whole: nn.Conv1d's U(-1/sqrt(W), 1/sqrt(W))."""
    return (2 * seeded_uniform(shape, seed, name) - 1) / math.sqrt(width)


def decay_init(heads: int, seed: int, name: str) -> tuple[Tensor, Tensor]:
    """(A_log, dt_bias) [heads] each, whole, drawn from (seed, f"{name}.A_log") and (seed, f"{name}.dt_bias")."""
    a = 1 + 15 * seeded_uniform((heads,), seed, f"{name}.A_log")
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(lo + (hi - lo) * seeded_uniform((heads,), seed, f"{name}.dt_bias"))
    return torch.log(a), dt + torch.log(-torch.expm1(-dt))
