"""Context parallelism for the recurrence by state passing: each rank sends one small map per slice, whatever the
length.

The sequence is cut into n equal slices of L tokens; cp rank r holds some of them (`slices`, global indices in
local order): one, r, for a contiguous split (n = cp), or two, r and 2 cp - 1 - r, for megalite's zigzag split
(n = 2 cp, megalite/context/zigzag.py). A slice of the recurrence is an affine map of the state entering it:
every step S <- exp(g) (I - beta k k^T) S + beta k v^T is linear in S (the erase included; a document start
multiplies S by 0), so over a slice

    S_out = M S_in + B        M [H, K, K] (the product of the steps' matrices), B [H, K, V] (S_out from zero)

and both come from one run of the chunked form on columns [v | 0] from the state [0 | I]: the state's columns
evolve independently, the identity's become M and v's become B. The ranks all-gather their [B | M] (fp32,
[B, H, K, V + K] per slice, independent of L), each rank folds the maps of the slices before each of its own in
order (dropping the state where a slice's first token starts a document) into that slice's true S_in, and runs
the slice again from S_in for the output. Compute: each slice twice (once K + V wide); bytes:
`costs.cp_exchange_bytes`, forward, and a reduce-scatter of the same size backward (each map receives the
gradients of every later slice's fold).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megalite.context.zigzag import zigzag_chunks
from megalite.parallel import comm
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from megalite.recurrent.engine import Backend, gated_delta
from megalite.recurrent.recurrence import RuleInputs, working_dtype

Tensor = torch.Tensor


class _GatherSlices(torch.autograd.Function):
    """[n_local, ...] per rank -> [cp n_local, ...] rank-major over cp; backward: the sum of every rank's gradient
    for this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, state: ParallelState) -> Tensor:  # type: ignore[override]
        ctx.state = state
        return comm.all_gather(local, state, "cp", dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return comm.reduce_scatter(grad.contiguous(), ctx.state, "cp", dim=0), None


class _Joined(torch.autograd.Function):
    """`x` unchanged, joined to `gathered` in the graph: a rank whose output reads none of the gathered rows must
    still reach `_GatherSlices`' backward, whose reduce-scatter every rank has to enter (a zero gradient here)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, gathered: Tensor) -> Tensor:  # type: ignore[override]
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def joined(x: Tensor, gathered: Tensor) -> Tensor:
    """`x`, made to depend on `gathered` for the backward (`_Joined`)."""
    return _Joined.apply(x, gathered)


def owned_slices(cp: int, cp_rank: int, zigzag: bool) -> tuple[int, ...]:
    """The global slice indices a cp rank holds, in local order: (r,) of cp, or zigzag's (r, 2 cp - 1 - r)."""
    return zigzag_chunks(cp, cp_rank) if zigzag else (cp_rank,)


def gather_slices(local: Tensor, state: ParallelState, zigzag: bool) -> Tensor:
    """Every rank's per-slice rows [slices per rank, ...] -> [n, ...] in global slice order."""
    order = [j for r in range(state.cp) for j in owned_slices(state.cp, r, zigzag)]
    gathered = _GatherSlices.apply(local, state)
    return gathered[torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=local.device)]


def slice_starts(doc_ids: Optional[Tensor], n: int) -> Optional[Tensor]:
    """[n, B] bool: whether slice j's first token starts a document (slice 0's: never, it starts the sequence)."""
    if doc_ids is None:
        return None
    length = doc_ids.shape[1] // n
    firsts = doc_ids[:, length::length][:, :n - 1]
    lasts = doc_ids[:, length - 1:-1:length][:, :n - 1]
    return torch.cat([torch.zeros_like(firsts[:, :1], dtype=torch.bool), firsts != lasts], dim=1).T


def state_passing_gated_delta(x: RuleInputs, *, doc_ids: Optional[Tensor], scale: float, state: ParallelState,
                              zigzag: bool = False, backend: Backend = "chunked", chunk_size: int = CHUNK) -> Tensor:
    """o [B, s, H, V] for this rank's tokens `x` ([B, s, ...]: its slice, or its two zigzag slices concatenated)
    of sequences that start from a zero state; `doc_ids` [B, S] are the whole sequences' document ids (or None),
    as every rank has them."""
    slices = owned_slices(state.cp, state.cp_rank, zigzag)
    b, local, h, dv = x.v.shape
    dk, per, n = x.k.shape[-1], len(slices), state.cp * len(slices)
    length = local // per
    if doc_ids is not None and doc_ids.shape[1] != n * length:
        raise ValueError(f"doc_ids cover {doc_ids.shape[1]} tokens, not {n} slices x {length}")

    def piece(t: Tensor, i: int) -> Tensor:
        return t[:, i * length:(i + 1) * length]

    def ids(j: int) -> Optional[Tensor]:
        return None if doc_ids is None else doc_ids[:, j * length:(j + 1) * length]

    work = working_dtype(x.v)  # the maps and states in fp32 (or fp64), whatever the activations' dtype
    start = torch.cat([torch.zeros(b, h, dk, dv, dtype=work, device=x.v.device),
                       torch.eye(dk, dtype=work, device=x.v.device).expand(b, h, dk, dk)], dim=-1)
    own = []
    for i, j in enumerate(slices):
        wide = RuleInputs(piece(x.q, i), piece(x.k, i), torch.cat([piece(x.v, i), x.v.new_zeros(b, length, h, dk)],
                                                                  dim=-1), piece(x.g, i), piece(x.beta, i))
        own.append(gated_delta(wide, doc_ids=ids(j), scale=scale, initial_state=start, backend=backend,
                               chunk_size=chunk_size)[1])
    maps = gather_slices(torch.stack(own), state, zigzag)              # [n, B, H, K, V + K]
    starts = slice_starts(doc_ids, n)
    outputs = []
    for i, j in enumerate(slices):
        incoming = maps.new_zeros(b, h, dk, dv)
        for m in range(j + 1):
            if starts is not None:
                incoming = torch.where(starts[m][:, None, None, None], torch.zeros_like(incoming), incoming)
            if m < j:
                incoming = maps[m][..., dv:] @ incoming + maps[m][..., :dv]
        part = RuleInputs(piece(x.q, i), piece(x.k, i), piece(x.v, i), piece(x.g, i), piece(x.beta, i))
        outputs.append(gated_delta(part, doc_ids=ids(j), scale=scale, initial_state=joined(incoming, maps),
                                   backend=backend, chunk_size=chunk_size)[0])
    return torch.cat(outputs, dim=1)
