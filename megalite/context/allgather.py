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

from dataclasses import replace

import torch

from megalite.attention.blocks import Backend, PositionMask
from megalite.attention.local import BlockCall, rows_backward, rows_forward
from megalite.attention.variant import PLAIN, AttentionVariant
from megalite.context.documents import DocumentIds
from megalite.context.group import GROUP, ContextGroup
from megalite.context.ring import RingCall, check_heads, stack_kv
from megalite.context.zigzag import zigzag_positions, zigzag_split
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def _global_causal_mask(seq_local: int, cpg: ContextGroup, device: torch.device,
                        window: int | None) -> PositionMask:
    """Local query i sees key j of the gathered (rank-ordered) K/V iff key j's position <= query i's (and within
    the window: the kernel skips the tiles wholly outside it, the torch block math masks them)."""
    seq = seq_local * cpg.cp
    q_pos = zigzag_positions(seq, cpg.cp, cpg.cp_rank, device)
    k_pos = torch.cat([zigzag_positions(seq, cpg.cp, r, device) for r in range(cpg.cp)])
    return PositionMask(q_pos, k_pos, window)


def _call(q: Tensor, positions: PositionMask, call: RingCall, sinks: Tensor | None) -> BlockCall:
    """The one block of the gathered K/V: the mask in global positions and (document masking) the same-document
    test, [b, sq, S]; the variant's scores and sinks."""
    keep = positions
    if call.docs is not None:
        key_docs = torch.cat([zigzag_split(call.docs.full, call.cpg.cp, r) for r in range(call.cpg.cp)], dim=1)
        keep = replace(positions, docs=(call.docs.local, key_docs))  # the keys in the gathered order
    return BlockCall(call.scores(q.shape[-1]), keep, call.backend, sinks)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None,  # type: ignore[override]
                call: RingCall) -> Tensor:
        kv_all = comm.all_gather(stack_kv(k, v), call.cpg.state, GROUP, dim=3)  # [2, b, hk, S, d]
        keep = _global_causal_mask(q.shape[1], call.cpg, q.device, call.variant.window)
        result, lse = rows_forward(q, kv_all[0], kv_all[1], _call(q, keep, call, sinks))
        ctx.save_for_backward(q, kv_all, result, lse, keep.query, keep.key)  # positions: O(S), not the S^2/cp mask
        ctx.call, ctx.sinks, ctx.kv_dtype = call, sinks, k.dtype
        return result

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, kv_all, out, lse, q_pos, k_pos = ctx.saved_tensors
        call: RingCall = ctx.call
        block = _call(q, PositionMask(q_pos, k_pos, call.variant.window), call, ctx.sinks)
        dq, dk_all, dv_all, d_sinks = rows_backward(q, kv_all[0], kv_all[1], out, lse, d_out, block)
        dkv = comm.reduce_scatter(torch.stack([dk_all, dv_all]), call.cpg.state, GROUP, dim=3)
        dk, dv = (t.transpose(1, 2).to(ctx.kv_dtype) for t in dkv)
        return dq.to(q.dtype), dk, dv, d_sinks, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, backend: Backend = "torch",
                        docs: DocumentIds | None = None, variant: AttentionVariant = PLAIN) -> Tensor:
    """Same contract as `ring_attention` (zigzag-split q/k/v in, this rank's rows of causal attention out, under
    the variant: the window in the mask, the soft-cap in the scores, the sinks once per row after the block)."""
    check_heads(q.shape[2], k.shape[2])
    if k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"allgather_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    call = RingCall(ContextGroup.of(state), backend, docs, variant)
    return _AllGatherAttention.apply(q, k, v, variant.sinks, call)
