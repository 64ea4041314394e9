"""Attention of whole sequences in position order under a variant, on one context-parallel rank (cp = 1).

The entry the model calls for a non-plain variant (megalite/model/attend.py); plain causal attention keeps the
backend's own kernel. Which path computes it, all equal to `reference_attention` (tests/test_attention_variants.py):

- `triton`: the flash kernel (kernels/flash_attention.py) takes the window (tiles wholly outside it are never
  visited), the soft-cap, the sinks (a rescale of each row by its log-sum-exp) and the documents (segment ids).
- `torch`, window / scale / documents only: SDPA under an explicit boolean mask, which is exact (softmax over
  the visible keys at the given scale is all these change).
- `torch`, with a soft-cap or sinks, which SDPA cannot express: the block math of blocks.py on the whole
  sequence as one block (`rows_forward`), in an autograd function that saves only q, k, v, the output and the
  log-sum-exp (the sinks folded in) and recomputes the scores in backward, as flash attention does.

Windows and documents together: a key is visible iff it is in the query's document AND within the window,
0 <= i - j < W in the sequence's positions (the window counts tokens of the packed row; inside a document that
is the same as counting from the document's start, since a document's tokens are consecutive)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megalite.attention.blocks import (CAUSAL, Backend, Mask, PositionMask, Scores, add_sinks, block_backward,
                                       block_forward, from_grouped, sink_grad, to_grouped)
from megalite.attention.variant import AttentionVariant, visible

Tensor = torch.Tensor


def sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], scale: float) -> Tensor:
    """Grouped-query SDPA under `keep` [B or 1, 1, Sq, Sk] bool (None: causal); q [B,S,Hq,D], k/v [B,S,Hk,D].
    The kv heads are repeated (SDPA's enable_gqa with an explicit mask is not on every backend; same numbers).
    Every query row must keep at least one key."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                         is_causal=keep is None, scale=scale)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class BlockCall:
    """What one block-math attention call needs beyond q, k, v: its scores (scale, soft-cap), its mask, the
    backend that computes the block and the sinks (None: none) folded in after it."""

    scores: Scores
    keep: Mask
    backend: Backend
    sinks: Optional[Tensor] = None


def rows_forward(q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor]:
    """q [b, sq, hq, d] against heads-first k/v [b, hk, sk, d] as one block: (the output [b, sq, hq, d] in q's
    dtype, the grouped fp32 log-sum-exp L' [b, hk, rep, sq], sinks included)."""
    out, lse = block_forward(to_grouped(q, k.shape[1]), k, v, call.scores, call.keep, call.backend)
    if call.sinks is not None:
        out, lse = add_sinks(out, lse, call.sinks)
    return from_grouped(out).to(q.dtype), lse


def rows_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor, call: BlockCall
                  ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The gradients of `rows_forward` (given its output and L'): dq [b, sq, hq, d] fp32, heads-first fp32
    dk/dv [b, hk, sk, d] and d sinks (None without sinks)."""
    hk = k.shape[1]
    dog = to_grouped(d_out, hk).float()
    delta = (dog * to_grouped(out, hk).float()).sum(dim=-1)                     # D' = rowsum(dO O')
    dq, dk, dv = block_backward(to_grouped(q, hk), k, v, dog, (lse, delta), call.scores, call.keep, call.backend)
    d_sinks = None if call.sinks is None else sink_grad(lse, delta, call.sinks)
    return from_grouped(dq), dk, dv, d_sinks


class _BlockAttention(torch.autograd.Function):
    """`rows_forward` with autograd: saves q, k, v, the output and L' only."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],  # type: ignore[override]
                call: BlockCall) -> Tensor:
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        out, lse = rows_forward(q, kh, vh, BlockCall(call.scores, call.keep, call.backend, sinks))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = BlockCall(call.scores, call.keep, call.backend, sinks)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, d_sinks = rows_backward(q, k.transpose(1, 2), v.transpose(1, 2), out, lse, d_out, ctx.call)
        return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), d_sinks, None


def variant_mask(seq_len: int, window: Optional[int], docs: Optional[Tensor], device: torch.device) -> Mask:
    """The block mask of a whole sequence in position order: CAUSAL, the window in positions, and under
    documents ([B, S] ids) the [B, S, S] boolean of both."""
    if docs is None:
        if window is None:
            return CAUSAL
        pos = torch.arange(seq_len, device=device)
        return PositionMask(pos, pos, window)
    pos = torch.arange(seq_len, device=device)
    return visible(pos, pos, window)[None] & (docs[:, :, None] == docs[:, None, :])


def variant_attention(q: Tensor, k: Tensor, v: Tensor, variant: AttentionVariant,
                      docs: Tensor | None = None, backend: str = "torch") -> Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hk, D] -> [B, S, Hq, D]; `docs` [B, S] document ids (document masking) or None.
    `backend` is the resolved model.kernels ('torch' or 'triton'). The sinks are this rank's query heads'."""
    scale = variant.softmax_scale(q.shape[-1])
    if backend == "triton":
        import megalite.kernels as kernels  # importing it does not import Triton

        return kernels.flash_attention(q, k, v, True, scale, docs, window=variant.window, softcap=variant.softcap,
                                       sinks=variant.sinks)
    if backend != "torch":
        raise ValueError(f"variant_attention backend {backend!r}: expected 'torch' or 'triton'")
    keep = variant_mask(q.shape[1], variant.window, docs, q.device)
    if variant.softcap is None and variant.sinks is None:
        if isinstance(keep, PositionMask):
            return sdpa(q, k, v, keep.keep()[None, None], scale)
        return sdpa(q, k, v, keep[:, None] if isinstance(keep, Tensor) else None, scale)
    return _BlockAttention.apply(q, k, v, variant.sinks, BlockCall(Scores(scale, variant.softcap), keep, "torch"))
