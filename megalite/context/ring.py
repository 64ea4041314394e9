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

Under a sliding window or document masking (`plan_step`) each step is planned per (query chunk, key chunk) pair:
a pair no query of which sees any of its keys is skipped, no FLOPs either way, and the ring tallies the pairs
it computes and skips on the counter (`cp_blocks_computed` / `cp_blocks_skipped`, attention/costs.py
`ring_blocks` for a window). A variant's soft-cap is in every block's scores, its sinks are added once per row
after the last merge (attention/blocks.py), and d sinks is this rank's rows' partial sum.

Bytes per rank per call (kv = elements of the local K and V together = 2 b (S/cp) hk d, e = their
element size): forward (cp-1) kv e; backward (cp-1) kv (e + 4) — the K/V again plus the fp32 dK/dV.
Memory: only this rank's K/V (and one block in flight) are kept; see `allgather.py` for the other form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.attention.blocks import (CAUSAL, Backend, Mask, PositionMask, Scores, add_sinks, block_backward,
                                       block_forward, from_grouped, merge_into, sink_grad, to_grouped)
from megalite.attention.costs import chunk_pair_visible
from megalite.attention.variant import PLAIN, AttentionVariant
from megalite.context.documents import DocumentIds
from megalite.context.group import GROUP, ContextGroup
from megalite.context.zigzag import zigzag_chunks, zigzag_positions, zigzag_split
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


@dataclass(frozen=True)
class _Block:
    rows: slice   # local query rows
    keys: slice   # rows of the owner's K/V
    keep: Mask


@dataclass(frozen=True)
class RingCall:
    """What a ring (or all-gather) call computes beyond q, k, v and the sinks: its ring of ranks, the backend of
    its blocks, the documents and the variant."""

    cpg: ContextGroup
    backend: Backend
    docs: DocumentIds | None
    variant: AttentionVariant

    def scores(self, head_dim: int) -> Scores:
        return Scores(self.variant.softmax_scale(head_dim), self.variant.softcap)


def _chunk(i: int, c: int) -> slice:
    return slice(i * c, (i + 1) * c)


def _span(a: slice, b: slice) -> slice:
    return slice(min(a.start, b.start), max(a.stop, b.stop))


def plan_step(call: RingCall, owner: int, c: int, device: torch.device) -> tuple[list[_Block], int, int]:
    """(the blocks to compute, chunk pairs computed, chunk pairs skipped) of this rank's queries against the
    owner's K/V. Plain causal: the one block of the module doc (3 chunk pairs at the diagonal step, 2 after).
    With a window or documents, each of the <= 4 (query chunk, key chunk) pairs the causal order leaves is kept
    only if some query of it sees some key (`chunk_pair_visible`; under documents, the same-document test too);
    the kept pairs of a query chunk form one block, and the two query chunks share a block when they keep the
    same key chunks. Skipped pairs cost no FLOPs; the K/V still travel on (later ranks may need them)."""
    cpg, window, docs = call.cpg, call.variant.window, call.docs
    if window is None and docs is None:
        rows, keys, causal = _step_blocks(owner, cpg.cp_rank, c)
        return [_Block(rows, keys, CAUSAL if causal else None)], 3 if owner == cpg.cp_rank else 2, 0
    seq = 2 * c * cpg.cp
    q_pos, k_pos = zigzag_positions(seq, cpg.cp, cpg.cp_rank, device), zigzag_positions(seq, cpg.cp, owner, device)
    key_docs = None if docs is None else zigzag_split(docs.full, cpg.cp, owner)

    def keep(rows: slice, keys: slice) -> PositionMask:
        both = None if docs is None or key_docs is None else (docs.local[:, rows], key_docs[:, keys])
        return PositionMask(q_pos[rows], k_pos[keys], window, both)

    kept: dict[int, list[int]] = {0: [], 1: []}
    computed = skipped = 0
    for qi, a in enumerate(zigzag_chunks(cpg.cp, cpg.cp_rank)):
        for ki, b in enumerate(zigzag_chunks(cpg.cp, owner)):
            if b > a:
                continue
            visible = chunk_pair_visible(a, b, c, window)
            if visible and docs is not None:
                visible = bool(keep(_chunk(qi, c), _chunk(ki, c)).keep().any())
            computed, skipped = computed + visible, skipped + (not visible)
            if visible:
                kept[qi].append(ki)
    groups = [(_span(_chunk(0, c), _chunk(1, c)), kept[0])] if kept[0] == kept[1] else \
        [(_chunk(qi, c), kept[qi]) for qi in (0, 1)]
    blocks = []
    for rows, kis in groups:
        if kis:
            keys = _span(_chunk(kis[0], c), _chunk(kis[-1], c))
            blocks.append(_Block(rows, keys, keep(rows, keys)))
    return blocks, computed, skipped


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None,  # type: ignore[override]
                call: RingCall) -> Tensor:
        cpg, scores = call.cpg, call.scores(q.shape[-1])
        hk, c = k.shape[2], q.shape[1] // 2
        qg = to_grouped(q, hk)
        kv = stack_kv(k, v)
        out = lse = None
        computed = skipped = 0
        for step in range(cpg.cp):
            nxt, works = _pass_on(kv, cpg) if step + 1 < cpg.cp else (kv, [])  # before computing with kv
            blocks, done, left = plan_step(call, (cpg.cp_rank - step) % cpg.cp, c, q.device)
            computed, skipped = computed + done, skipped + left
            for blk in blocks:
                blk_out, blk_lse = block_forward(qg[:, :, :, blk.rows], kv[0][:, :, blk.keys], kv[1][:, :, blk.keys],
                                                 scores, blk.keep, call.backend)
                if out is None or lse is None:
                    if blk.rows == slice(0, 2 * c):
                        out, lse = blk_out, blk_lse    # the plain diagonal block covers every query row
                        continue
                    out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
                    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
                merge_into(out[:, :, :, blk.rows], lse[:, :, :, blk.rows], blk_out, blk_lse)
            _wait(works)
            kv = nxt
        assert out is not None and lse is not None          # step 0 always computes: every token sees itself
        cpg.state.counter.tally("cp_blocks_computed", computed)
        cpg.state.counter.tally("cp_blocks_skipped", skipped)
        if sinks is not None:                        # once per row, every block merged (blocks.py)
            out, lse = add_sinks(out, lse, sinks)
        result = from_grouped(out).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.call, ctx.sinks = call, sinks
        return result

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        call: RingCall = ctx.call
        cpg, scores = call.cpg, call.scores(q.shape[-1])
        hk, c = k.shape[2], q.shape[1] // 2
        qg, dog = to_grouped(q, hk), to_grouped(d_out, hk).float()
        delta = (dog * to_grouped(out, hk).float()).sum(dim=-1)               # D = rowsum(dO * O)
        dq = torch.zeros_like(qg, dtype=torch.float32)
        kv = stack_kv(k, v)
        own = acc_in = None
        acc_works: list[dist.Work] = []
        for step in range(cpg.cp):
            nxt, kv_works = _pass_on(kv, cpg) if step + 1 < cpg.cp else (kv, [])
            blocks, _, _ = plan_step(call, (cpg.cp_rank - step) % cpg.cp, c, q.device)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for blk in blocks:
                r = blk.rows
                dq_blk, dk_blk, dv_blk = block_backward(qg[:, :, :, r], kv[0][:, :, blk.keys], kv[1][:, :, blk.keys],
                                                        dog[:, :, :, r], (lse[:, :, :, r], delta[:, :, :, r]),
                                                        scores, blk.keep, call.backend)
                dq[:, :, :, r] += dq_blk
                dkv[0][:, :, blk.keys] += dk_blk
                dkv[1][:, :, blk.keys] += dv_blk
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
        d_sinks = None if ctx.sinks is None else sink_grad(lse, delta, ctx.sinks)
        return from_grouped(dq).to(q.dtype), dk, dv, d_sinks, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, backend: Backend = "torch",
                   docs: DocumentIds | None = None, variant: AttentionVariant = PLAIN,
                   ring: ContextGroup | None = None) -> Tensor:
    """Causal GQA attention of this rank's zigzag-split queries against the whole sequence's keys/values.

    q [b, S/cp, hq, d], k/v [b, S/cp, hk, d] (this rank's two chunks, `zigzag_split`) -> [b, S/cp, hq, d],
    equal to the matching rows of causal attention over the unsplit sequence. Collective over the state's
    'cp' ring (bytes counted under 'cp'): every rank of the ring must call it with the same shapes.
    `backend` computes each block pair: the torch block math or the Triton flash kernel (the model's kernels).
    `docs` (document masking, either backend): attend within documents only; block pairs no query of which sees
    any key are skipped (`plan_step`). `variant` (window, sinks, soft-cap, scale; variant.py): the window cuts the
    chunk pairs wholly outside it (skipped, counted: the counter's tallies "cp_blocks_computed" and
    "cp_blocks_skipped", per forward, in chunk pairs of S / (2 cp) tokens; attention/costs.py `ring_blocks`), the
    soft-cap is in every block's scores, the sinks are added once per row after the merge. `ring`: the ranks the K/V go around (default: the whole 'cp' group;
    hybrid cp passes its shorter ring, `ContextGroup.ring_of`), q/k/v then being that ring's zigzag split.
    """
    check_heads(q.shape[2], k.shape[2])
    if q.shape[1] % 2 or k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected equal local lengths, even (two zigzag chunks)")
    return _RingAttention.apply(q, k, v, variant.sinks, RingCall(ring or ContextGroup.of(state), backend, docs, variant))
