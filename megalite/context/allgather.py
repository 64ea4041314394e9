"""Context-parallel attention by all-gathering K/V (the form Llama 3 used; Dubey et al. 2024, section 3.3.2).

Each rank gathers every rank's K/V (one all-gather of the stacked [K; V]), computes its zigzag-split
queries against the whole sequence with the causal mask written in global positions (query position >=
key position), and in backward reduce-scatters the full-sequence dK/dV (in fp32) back to their owners.

Bytes per rank per call (kv = 2 b (S/cp) hk d elements of the local K and V, e = their element size):
forward (cp-1) kv e (the all-gather), backward (cp-1) kv 4 (the fp32 reduce-scatter): (cp-1) kv e less
than the ring, which sends the K/V around again in backward. The price is memory and overlap: this form
keeps the full-sequence K/V (cp times the local one) from forward to backward, and its transfers are not
hidden behind compute. With GQA the K/V are small (hk << hq), which is why Llama 3 chose it; it also takes
any mask (document masks) since every rank sees every key. The ring (`ring.py`) is the default for long
sequences, where holding the full K/V on every rank is what context parallelism exists to avoid.
"""

from __future__ import annotations

import math

import torch

from megalite.context.blockwise import (Backend, Mask, PositionMask, block_backward, block_forward, from_grouped,
                                        to_grouped)
from megalite.context.documents import DocumentIds, document_mask
from megalite.context.group import GROUP, ContextGroup
from megalite.context.ring import check_heads, stack_kv
from megalite.context.zigzag import zigzag_positions, zigzag_split
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def _global_causal_mask(seq_local: int, cpg: ContextGroup, device: torch.device) -> PositionMask:
    """Local query i sees key j of the gathered (rank-ordered) K/V iff key j's position <= query i's."""
    seq = seq_local * cpg.cp
    q_pos = zigzag_positions(seq, cpg.cp, cpg.cp_rank, device)
    k_pos = torch.cat([zigzag_positions(seq, cpg.cp, r, device) for r in range(cpg.cp)])
    return PositionMask(q_pos, k_pos)


def _mask(positions: PositionMask, docs: DocumentIds | None, cp: int) -> Mask:
    """The causal mask in global positions, and (document masking) the same-document test, [b, sq, S]."""
    if docs is None:
        return positions
    key_docs = torch.cat([zigzag_split(docs.full, cp, r) for r in range(cp)], dim=1)  # the gathered order
    return positions.keep() & document_mask(docs.local, key_docs, causal=False)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cpg: ContextGroup, scale: float,  # type: ignore[override]
                backend: Backend, docs: DocumentIds | None) -> Tensor:
        kv_all = comm.all_gather(stack_kv(k, v), cpg.state, GROUP, dim=3)  # [2, b, hk, S, d]
        keep = _global_causal_mask(q.shape[1], cpg, q.device)
        out, lse = block_forward(to_grouped(q, k.shape[2]), kv_all[0], kv_all[1], scale, _mask(keep, docs, cpg.cp),
                                 backend)
        result = from_grouped(out).to(q.dtype)
        ctx.save_for_backward(q, kv_all, result, lse, keep.query, keep.key)  # positions: O(S), not the S^2/cp mask
        ctx.cpg, ctx.scale, ctx.kv_dtype, ctx.backend, ctx.docs = cpg, scale, k.dtype, backend, docs
        return result

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, kv_all, out, lse, q_pos, k_pos = ctx.saved_tensors
        hk = kv_all.shape[2]
        dog = to_grouped(d_out, hk).float()
        delta = (dog * to_grouped(out, hk).float()).sum(dim=-1)
        dq, dk_all, dv_all = block_backward(to_grouped(q, hk), kv_all[0], kv_all[1], dog, (lse, delta),
                                            ctx.scale, _mask(PositionMask(q_pos, k_pos), ctx.docs, ctx.cpg.cp),
                                            ctx.backend)
        dkv = comm.reduce_scatter(torch.stack([dk_all, dv_all]), ctx.cpg.state, GROUP, dim=3)
        dk, dv = (t.transpose(1, 2).to(ctx.kv_dtype) for t in dkv)
        return from_grouped(dq).to(q.dtype), dk, dv, None, None, None, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState,
                        scale: float | None = None, backend: Backend = "torch", docs: DocumentIds | None = None
                        ) -> Tensor:
    """Same contract as `ring_attention` (zigzag-split q/k/v in, this rank's rows of causal attention out)."""
    check_heads(q.shape[2], k.shape[2])
    if k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"allgather_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _AllGatherAttention.apply(q, k, v, ContextGroup.of(state), scale, backend, docs)
