"""The one entry point to the recurrence: `gated_delta(..., backend=)` picks a form, all three equal.

    recurrent  one token at a time (recurrence.py): the definition, O(T) sequential steps
    chunked    the WY / UT chunked form in torch (chunked.py): the default off-GPU, and every gate
    triton     the chunk kernels (kernels/gated_delta.py), forward and backward: all three gates
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from megalite import kernels
from megalite.recurrent.chunked import CHUNK, chunked_gated_delta
from megalite.recurrent.recurrence import RuleInputs, expand_groups, recurrent_gated_delta, zero_state

Tensor = torch.Tensor
Backend = Literal["recurrent", "chunked", "triton"]
BACKENDS: tuple[Backend, ...] = ("recurrent", "chunked", "triton")


def gated_delta(x: RuleInputs, *, doc_ids: Optional[Tensor], scale: float, initial_state: Optional[Tensor] = None,
                erase: bool = True, backend: Backend = "chunked", chunk_size: int = CHUNK) -> tuple[Tensor, Tensor]:
    """(o [B, T, H, V], final state [B, H, K, V]): the recurrence of megalite/recurrent/recurrence.py.
    `doc_ids` [B, T] or None (one document per row) is required: packed batches restart the state at every
    document."""
    if backend == "recurrent":
        return recurrent_gated_delta(x, doc_ids=doc_ids, scale=scale, initial_state=initial_state, erase=erase)
    if backend == "chunked":
        return chunked_gated_delta(x, doc_ids=doc_ids, scale=scale, initial_state=initial_state, erase=erase,
                                   chunk_size=chunk_size)
    if backend != "triton":
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    x.check(doc_ids)
    h = x.v.shape[2]
    state = zero_state(x.v, x.k.shape[-1]).float() if initial_state is None else initial_state
    docs = torch.zeros(x.v.shape[:2], dtype=torch.long, device=x.v.device) if doc_ids is None else doc_ids
    o, final = kernels.ChunkGatedDelta.apply(expand_groups(x.q, h), expand_groups(x.k, h), x.v, x.g, x.beta, state,
                                             docs, scale, chunk_size, erase)
    return o, final
