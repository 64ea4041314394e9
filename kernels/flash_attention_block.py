"""One key block of a longer attention, for context parallelism: (O, LSE) out, the merged LSE in.

Ring attention (megalite/context/ring.py; Liu et al. 2023) splits one softmax over several key blocks.
Per block it needs (O_j, LSE_j) to merge the blocks (L = log sum_j exp L_j, O = sum_j exp(L_j - L) O_j,
the online softmax of Milakov & Gimelshein 2018 lifted to whole blocks), and in backward the FINAL L and
D = rowsum(dO * O) of the merged result, from which each block's P = exp(S - L) is exact, so the
FlashAttention-2 backward gives exactly this block's share of dQ, dK, dV.

Same Triton kernels as `flash_attention.py` (they take separate query/key lengths and, for the all-gather
form and any block a window or documents cut into, a mask in global token positions and the query rows' and
keys' document ids); only the host side differs: no autograd, fp32 outputs (the
caller merges and accumulates in fp32), natural-log LSE at the boundary (base 2 stays inside the kernels).
"""

from __future__ import annotations

import torch

from .flash_attention import Positions, _backward, _check, _forward, _scale, _unit_last
from .flash_attention_variant import LN2, LOG2E, Segments, Variant, check_variant
from .flash_attention_reference import _reference_scores, _reference_values


def _check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, positions: Positions,
                 name: str, variant: Variant = Variant(), segments: Segments = None) -> None:
    _check(q, k, v, name, same_length=False)
    check_variant(variant, causal or positions is not None, q.shape[2], name)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"{name}: a causal block must be square (SQ == SK), got SQ {q.shape[1]}, SK {k.shape[1]}")
    if positions is not None and (causal or positions[0].shape != q.shape[1:2] or positions[1].shape != k.shape[1:2]
                                  or positions[0].is_floating_point() or positions[1].is_floating_point()):
        raise ValueError(f"{name}: positions must be integer vectors [SQ], [SK] (got "
                         f"{tuple(positions[0].shape)}, {tuple(positions[1].shape)} for SQ {q.shape[1]}, "
                         f"SK {k.shape[1]}) and exclude causal")
    if segments is not None and (segments[0].shape != q.shape[:2] or segments[1].shape != k.shape[:2]
                                 or segments[0].is_floating_point() or segments[1].is_floating_point()):
        raise ValueError(f"{name}: segments must be integer document ids [B, SQ] = {tuple(q.shape[:2])} and "
                         f"[B, SK] = {tuple(k.shape[:2])}, got {tuple(segments[0].shape)}, {tuple(segments[1].shape)}")


def _heads_first(shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """An fp32 [B, S, H, D] view of contiguous [B, H, S, D] memory (the caller's grouped-head layout)."""
    B, S, H, D = shape
    return torch.empty((B, H, S, D), dtype=torch.float32, device=like.device).transpose(1, 2)


def flash_attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                          softmax_scale: float | None = None, positions: Positions = None,
                          window: int | None = None, softcap: float | None = None,
                          tiles: torch.Tensor | None = None, segments: Segments = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) of q [B, SQ, Hq, D] against one block of keys k/v [B, SK, Hk, D] (any strides with a unit
    last dim). Mask: `causal` (key j <= query i; needs SQ == SK), or `positions` = (query positions [SQ],
    key positions [SK]) for causal attention in global token positions (key j visible to query i iff
    key[j] <= query[i]: the all-gather form of context parallelism), or neither; `window` (with either mask:
    key j also needs query - key < W; tiles wholly outside are skipped), `softcap` (scores c tanh(s / c)),
    `tiles` (an int32 [3] visit counter, `flash_attention_variant.Variant`), `segments` = (query document ids [B, SQ],
    key document ids [B, SK]): key j also needs query i's document (tiles sharing none are skipped). A row that sees no key of the block gets
    O = 0 and LSE = -inf. O: fp32 [B, SQ, Hq, D], a view of [B, Hq, SQ, D] memory; LSE: fp32 [B, Hq, SQ],
    LSE[b, h, i] = log sum_j exp(scale q_i . k_j) over the visible keys of this block.
    No autograd: see `flash_attention_block_backward`."""
    variant = Variant(window, softcap, None, tiles)
    _check_block(q, k, v, causal, positions, "flash_attention_block", variant, segments)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, SQ, Hq, _ = q.shape
    o = _heads_first(q.shape, q)
    lse2 = torch.empty((B * Hq, SQ), dtype=torch.float32, device=q.device)
    _forward(q, k, v, o, lse2, causal, _scale(q, softmax_scale), positions, segments, variant)
    return o, lse2.view(B, Hq, SQ).mul_(LN2)


def flash_attention_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                                   lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                                   softmax_scale: float | None = None, positions: Positions = None,
                                   window: int | None = None, softcap: float | None = None,
                                   tiles: torch.Tensor | None = None, segments: Segments = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This key block's share of the gradients: (dQ [B, SQ, Hq, D], dK, dV [B, SK, Hk, D]), fp32 views of
    heads-first memory. `lse` and `delta` ([B, Hq, SQ]) are the statistics of the WHOLE softmax the query
    rows belong to (every block merged), not of this block alone; dQ of the blocks sum to the full dQ.
    dO is cast to q's dtype (the matmul operands must agree; lossless when the gradient arrived in it).
    The mask (`causal` / `positions`, `window`, `segments`) must be the forward's."""
    variant = Variant(window, softcap, None, tiles)
    _check_block(q, k, v, causal, positions, "flash_attention_block_backward", variant, segments)
    B, SQ, Hq, _ = q.shape
    if do.shape != q.shape or lse.shape != (B, Hq, SQ) or delta.shape != (B, Hq, SQ):
        raise ValueError(f"flash_attention_block_backward: do {tuple(do.shape)}, lse {tuple(lse.shape)}, delta "
                         f"{tuple(delta.shape)} for q {tuple(q.shape)}; expected do like q, lse/delta [B, Hq, SQ]")
    q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do.to(q.dtype))
    lse2 = (lse.float() * LOG2E).contiguous().view(B * Hq, SQ)
    delta = delta.float().contiguous().view(B * Hq, SQ)
    dq, dk, dv = (_heads_first(t.shape, t) for t in (q, k, v))
    _backward(q, k, v, do, lse2, delta, dq, dk, dv, causal, _scale(q, softmax_scale), positions, segments, variant)
    return dq, dk, dv


def flash_attention_block_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                                    softmax_scale: float | None = None, positions: Positions = None,
                                    window: int | None = None, softcap: float | None = None,
                                    segments: Segments = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention_block` materialised in fp32 (differentiable): (O [B, SQ, Hq, D], LSE [B, Hq, SQ])."""
    _check_block(q, k, v, causal, positions, "flash_attention_block_reference", Variant(window, softcap), segments)
    scores = _reference_scores(q, k, causal, softmax_scale, positions, Variant(window, softcap))
    if segments is not None:
        scores = scores.masked_fill((segments[0][:, :, None] != segments[1][:, None, :])[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = (scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp()  # a row with no key: exp(-inf) = 0, O = 0
    return (p @ _reference_values(v, q.shape[2] // k.shape[2])).transpose(1, 2), lse
