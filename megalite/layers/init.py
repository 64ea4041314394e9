"""Layout-invariant initialisation: every weight is drawn in full, from a generator seeded by the
model seed and the parameter's *global* name, and only then sliced for this rank.

So `layers.3.mlp.down` gets the same numbers whether the model runs on 1 rank or is cut by TP/PP
(every layout computes the same thing): a parity test can compare layouts from step 0, and a 1-rank run is the
reference for every other layout. Costs one full-size temporary per parameter at start-up.
"""

from __future__ import annotations

import zlib

import torch


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, crc32 is not."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_normal(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """The full (unsharded) fp32 weight N(0, std^2) for parameter `name`."""
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std
