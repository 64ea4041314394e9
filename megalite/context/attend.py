"""The model's one call into context parallelism: this rank's attention rows by the configured cp mode."""

from __future__ import annotations

import torch

from megalite.context.allgather import allgather_attention
from megalite.context.blockwise import Backend
from megalite.context.options import ContextOptions
from megalite.context.ring import ring_attention
from megalite.context.ulysses import LocalAttention, a2a_attention
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def context_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, options: ContextOptions,
                      attend: LocalAttention, backend: Backend) -> Tensor:
    """Causal attention of this rank's zigzag-split q/k/v against the whole sequence ([b, S/cp, h, d] in
    and out). ring / allgather compute block pairs on `backend` (torch block math or the flash kernel);
    a2a runs `attend`, the model's whole-sequence kernel, on its heads/cp."""
    if options.mode == "ring":
        return ring_attention(q, k, v, state, backend=backend)
    if options.mode == "allgather":
        return allgather_attention(q, k, v, state, backend=backend)
    if options.mode == "a2a":
        return a2a_attention(q, k, v, state, attend)
    raise ValueError(f"cp mode {options.mode!r}: expected one of ring, allgather, a2a")
