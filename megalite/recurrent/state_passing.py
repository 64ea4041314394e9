"""Context parallelism for the recurrence by state passing: each rank sends one small map, whatever the length.

cp rank r holds the contiguous tokens [r L, (r+1) L) of each sequence (L = S / cp). A slice of the recurrence is
an affine map of the state entering it: every step S <- exp(g) (I - beta k k^T) S + beta k v^T is linear in S
(the erase included; a document start multiplies S by 0), so over the slice

    S_out = M S_in + B        M [H, K, K] (the product of the steps' matrices), B [H, K, V] (S_out from zero)

and both come from one run of the chunked form on columns [v | 0] from the state [0 | I]: the state's columns
evolve independently, the identity's become M and v's become B. The ranks all-gather their [B | M] (fp32,
[B, H, K, K + V] each, independent of L), rank r folds the maps of ranks 0..r-1 in order (dropping the state at a
rank whose first token starts a document) into its true S_in, and runs its slice again from S_in for the output.
Compute: the slice twice (once K + V wide); bytes: `costs.cp_exchange_bytes`, forward, and a reduce-scatter of
the same size backward (each rank's map receives the gradients of every later rank's fold).

This is the engine-level function; the layer and the model's cp layouts do not use it yet (the zigzag split
that balances causal attention gives each rank two slices: this needs contiguous ones, or two maps per rank).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megalite.parallel import comm
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from megalite.recurrent.engine import Backend, gated_delta
from megalite.recurrent.recurrence import RuleInputs

Tensor = torch.Tensor


class _GatherMaps(torch.autograd.Function):
    """All-gather of each rank's map over cp; backward: the sum of every rank's gradient for this rank's map."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, state: ParallelState) -> Tensor:  # type: ignore[override]
        ctx.state = state
        return comm.all_gather(local[None], state, "cp", dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return comm.reduce_scatter(grad.contiguous(), ctx.state, "cp", dim=0)[0], None


class _Exchanged(torch.autograd.Function):
    """`incoming` unchanged, joined to the gathered maps in the graph: rank 0 reads no map, yet its backward must
    reach `_GatherMaps` too, whose reduce-scatter every rank has to enter (a zero gradient from here)."""

    @staticmethod
    def forward(ctx: Any, incoming: Tensor, maps: Tensor) -> Tensor:  # type: ignore[override]
        ctx.maps_shape, ctx.maps_dtype = maps.shape, maps.dtype
        return incoming.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return grad, grad.new_zeros(ctx.maps_shape, dtype=ctx.maps_dtype)


def slice_starts(doc_ids: Optional[Tensor], cp: int) -> Optional[Tensor]:
    """[cp, B] bool: whether rank j's first token starts a document (rank 0's: never, it starts the sequence)."""
    if doc_ids is None:
        return None
    length = doc_ids.shape[1] // cp
    firsts = doc_ids[:, length::length][:, :cp - 1]
    lasts = doc_ids[:, length - 1:-1:length][:, :cp - 1]
    return torch.cat([torch.zeros_like(firsts[:, :1], dtype=torch.bool), firsts != lasts], dim=1).T


def state_passing_gated_delta(x: RuleInputs, *, doc_ids: Optional[Tensor], scale: float, state: ParallelState,
                              backend: Backend = "chunked", chunk_size: int = CHUNK) -> Tensor:
    """o [B, L, H, V] for this rank's slice `x` ([B, L, ...], tokens [r L, (r+1) L)) of sequences that start from a
    zero state; `doc_ids` [B, S] are the whole sequences' document ids (or None), as every rank has them."""
    cp, r = state.cp, state.cp_rank
    b, length, h, dv = x.v.shape
    dk = x.k.shape[-1]
    if doc_ids is not None and doc_ids.shape[1] != cp * length:
        raise ValueError(f"doc_ids cover {doc_ids.shape[1]} tokens, not cp x {length}")
    local_ids = None if doc_ids is None else doc_ids[:, r * length:(r + 1) * length]
    wide = RuleInputs(x.q, x.k, torch.cat([x.v, x.v.new_zeros(b, length, h, dk)], dim=-1), x.g, x.beta)
    start = torch.cat([x.v.new_zeros(b, h, dk, dv), torch.eye(dk, dtype=x.v.dtype).expand(b, h, dk, dk)], dim=-1)
    _, own_map = gated_delta(wide, doc_ids=local_ids, scale=scale, initial_state=start, backend=backend,
                             chunk_size=chunk_size)
    maps = _GatherMaps.apply(own_map, state)                           # [cp, B, H, K, V + K]
    starts = slice_starts(doc_ids, cp)
    incoming = x.v.new_zeros(b, h, dk, dv)
    for j in range(r + 1):
        if starts is not None:
            incoming = torch.where(starts[j][:, None, None, None], torch.zeros_like(incoming), incoming)
        if j < r:
            incoming = maps[j][..., dv:] @ incoming + maps[j][..., :dv]
    incoming = _Exchanged.apply(incoming, maps)
    o, _ = gated_delta(x, doc_ids=local_ids, scale=scale, initial_state=incoming, backend=backend,
                       chunk_size=chunk_size)
    return o
