"""Ring attention over a zigzag-split sequence (Liu et al. 2023; the zigzag load balance as in
Megatron-LM's context parallelism).

Each of the cp ranks holds 2c = S/cp tokens: chunks r and 2cp-1-r of the sequence (`zigzag.py`), its
queries and its K/V. Forward, in cp steps: at step i the rank holds the K/V of rank j = r - i (mod cp),
posts the transfer of that K/V to rank r+1 (and the receive of the next one from r-1) *before* computing
with it, so the transfer overlaps the compute, then merges the block's (O, LSE) into its running result.
The causal mask between the local queries and rank j's K/V has only three shapes (chunk granularity):

    j == r   both chunks, causal: the local tokens are in position order, a plain causal mask
    j <  r   key chunk j precedes both query chunks; key chunk 2cp-1-j follows both:
             all 2c queries x the first c keys, no mask
    j >  r   both key chunks precede query chunk 2cp-1-r and follow query chunk r:
             the last c queries x all 2c keys, no mask

so every step but the first computes exactly c x 2c scores on every rank: balanced.

Backward: the K/V go around the ring again, each rank adds its dQ locally and its share of dK/dV for the
block it holds to an fp32 accumulator that travels with that block: it starts at the owner's successor
and, after cp-1 hops, lands back at the owner, which adds its own share (computed at step 0).

Bytes per rank per call (kv = elements of the local K and V together = 2 b (S/cp) hk d, e = their
element size): forward (cp-1) kv e; backward (cp-1) kv (e + 4) — the K/V again plus the fp32 dK/dV.
Memory: only this rank's K/V (and one block in flight) are kept; see `allgather.py` for the other form.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite.context.blockwise import (CAUSAL, Backend, Mask, block_backward, block_forward, from_grouped,
                                        merge_into, to_grouped)
from megalite.context.documents import DocumentIds, document_mask
from megalite.context.group import GROUP, ContextGroup
from megalite.context.zigzag import zigzag_split
from megalite.errors import ConfigError
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def stack_kv(k: Tensor, v: Tensor) -> Tensor:
    """[b, s, hk, d] K and V -> one contiguous [2, b, hk, s, d] buffer: one message per transfer."""
    return torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()


def _pass_on(t: Tensor, cpg: ContextGroup) -> tuple[Tensor, list[dist.Work]]:
    """Post the send of `t` to our successor and the receive of the predecessor's into a new buffer."""
    received = torch.empty_like(t)
    works = comm.send_recv_async([t], [received], cpg.state, GROUP, cpg.next_rank, cpg.prev_rank)
    return received, works


def _step_blocks(owner: int, cp_rank: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal?) of the local-queries x owner's-K/V block pair (module doc)."""
    if owner == cp_rank:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if owner < cp_rank:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


def _block_mask(docs: DocumentIds | None, cpg: ContextGroup, owner: int, rows: slice, keys: slice,
                causal: bool) -> tuple[Mask, bool]:
    """(mask, skip) of a block pair: the chunk-level causal shape, and under document masking the same-document
    test too; `skip` when no query of the block sees any of its keys (its FLOPs are saved; its K/V still
    travel on, the next rank may need them, so the bytes do not change)."""
    if docs is None:
        return (CAUSAL if causal else None), False
    keep = document_mask(docs.local[:, rows], zigzag_split(docs.full, cpg.cp, owner)[:, keys], causal)
    return keep, not bool(keep.any())


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cpg: ContextGroup, scale: float,  # type: ignore[override]
                backend: Backend, docs: DocumentIds | None) -> Tensor:
        hk, c = k.shape[2], q.shape[1] // 2
        qg = to_grouped(q, hk)
        kv = stack_kv(k, v)
        out = lse = None
        for step in range(cpg.cp):
            nxt, works = _pass_on(kv, cpg) if step + 1 < cpg.cp else (kv, [])  # before computing with kv
            owner = (cpg.cp_rank - step) % cpg.cp
            rows, keys, causal = _step_blocks(owner, cpg.cp_rank, c)
            keep, skip = _block_mask(docs, cpg, owner, rows, keys, causal)
            if not skip:                           # never at step 0: every token sees itself
                blk_out, blk_lse = block_forward(qg[:, :, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale,
                                                 keep, backend)
                if out is None or lse is None:
                    out, lse = blk_out, blk_lse    # step 0 covers every query row
                else:
                    merge_into(out[:, :, :, rows], lse[:, :, :, rows], blk_out, blk_lse)
            _wait(works)
            kv = nxt
        assert out is not None and lse is not None
        result = from_grouped(out).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.cpg, ctx.scale, ctx.backend, ctx.docs = cpg, scale, backend, docs
        return result

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        cpg: ContextGroup = ctx.cpg
        hk, c = k.shape[2], q.shape[1] // 2
        qg, dog = to_grouped(q, hk), to_grouped(d_out, hk).float()
        delta = (dog * to_grouped(out, hk).float()).sum(dim=-1)               # D = rowsum(dO * O)
        dq = torch.zeros_like(qg, dtype=torch.float32)
        kv = stack_kv(k, v)
        own = acc_in = None
        acc_works: list[dist.Work] = []
        for step in range(cpg.cp):
            nxt, kv_works = _pass_on(kv, cpg) if step + 1 < cpg.cp else (kv, [])
            owner = (cpg.cp_rank - step) % cpg.cp
            rows, keys, causal = _step_blocks(owner, cpg.cp_rank, c)
            keep, skip = _block_mask(ctx.docs, cpg, owner, rows, keys, causal)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if not skip:
                dq_blk, dk_blk, dv_blk = block_backward(qg[:, :, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                                        dog[:, :, :, rows], (lse[:, :, :, rows],
                                                        delta[:, :, :, rows]), scale=ctx.scale, keep=keep,
                                                        backend=ctx.backend)
                dq[:, :, :, rows] += dq_blk
                dkv[0][:, :, keys], dkv[1][:, :, keys] = dk_blk, dv_blk
            if step == 0:
                own = dkv                            # our share of our own block: added when the rest returns
            else:
                _wait(acc_works)                     # the accumulator for this block, from the previous rank
                acc = dkv if acc_in is None else dkv.add_(acc_in)
                acc_in, acc_works = _pass_on(acc, cpg)
            _wait(kv_works)
            kv = nxt
        _wait(acc_works)
        assert own is not None
        if acc_in is not None:
            own.add_(acc_in)
        dk, dv = own[0].transpose(1, 2).to(k.dtype), own[1].transpose(1, 2).to(v.dtype)
        return from_grouped(dq).to(q.dtype), dk, dv, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, scale: float | None = None,
                   backend: Backend = "torch", docs: DocumentIds | None = None,
                   ring: ContextGroup | None = None) -> Tensor:
    """Causal GQA attention of this rank's zigzag-split queries against the whole sequence's keys/values.

    q [b, S/cp, hq, d], k/v [b, S/cp, hk, d] (this rank's two chunks, `zigzag_split`) -> [b, S/cp, hq, d],
    equal to the matching rows of causal attention over the unsplit sequence. Collective over the state's
    'cp' ring (bytes counted under 'cp'): every rank of the ring must call it with the same shapes.
    `backend` computes each block pair: the torch block math or the Triton flash kernel (the model's kernels).
    `docs` (document masking, torch backend): attend within documents only; block pairs no query of which sees
    any key are skipped (`_block_mask`). `ring`: the ranks the K/V go around (default: the whole 'cp' group;
    hybrid cp passes its shorter ring, `ContextGroup.ring_of`), q/k/v then being that ring's zigzag split.
    """
    check_heads(q.shape[2], k.shape[2])
    if q.shape[1] % 2 or k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected equal local lengths, even (two zigzag chunks)")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, ring or ContextGroup.of(state), scale, backend, docs)
