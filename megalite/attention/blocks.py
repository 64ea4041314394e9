"""Attention of a block of queries against a block of keys, returning the log-sum-exp, in plain torch.

The building block of ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers") and
of flash attention (Dao et al. 2022): a query row's softmax over several key blocks is recovered exactly
from each block's output O_j and log-sum-exp L_j (the online softmax, Milakov & Gimelshein 2018):

    L = log(sum_j exp(L_j)),   O = sum_j exp(L_j - L) O_j

and the backward needs, per block, only the final L and D = rowsum(dO * O):

    P = exp(S - L),  dV = P^T dO,  dS = P * (dO V^T - D),  dQ = scale dS K,  dK = scale dS^T Q.

Variants (megalite/attention/variant.py) enter the block math in three places:
- the window is part of the mask (`PositionMask.window`: key j visible to query i iff 0 <= i - j < W, in global
  token positions), so a block holds exactly the pairs the layer sees;
- the soft-cap is part of the scores: S = c tanh(scale q k^T / c), and in backward dS passes through its
  derivative, dS_raw = dS (1 - tanh^2) = dS (1 - (S / c)^2), before dQ and dK;
- the sinks are NOT a block's business: one extra logit per row in the whole row's denominator, so they are
  applied once, after every block is merged (`add_sinks`): L' = log(exp(L) + exp(sink)), O' = O exp(L - L')
  = O sigmoid(L - sink). The backward then takes L' and D' = rowsum(dO O') as it takes L and D: P = exp(S - L')
  are the probabilities with the sink in the denominator, and the sink's own probability exp(sink - L') has
  a value of zero, so dS = P (dP - D') is unchanged and d sink = -sum_rows exp(sink - L') D' (`sink_grad`).

Layout: heads first, grouped for GQA. q is [b, hk, rep, sq, d] (query head h = kv_head * rep + i reads
kv head h // rep, as in megalite.model.ops.attention), k/v are [b, hk, sk, d]; L and D are
[b, hk, rep, sq]. Everything is computed in fp32 whatever the input dtype.

Two backends compute a block pair, chosen by the `backend` argument (the resolved `model.kernels`):
- "torch": the readable reference below; it materialises the [sq, sk] scores of one block pair.
- "triton": the flash-attention kernel (`kernels.flash_attention_block` and its backward): the scores
  stay in on-chip tiles, O and L come out in fp32, and the backward takes the final L and D like the
  math above. It takes the masks context parallelism needs: None, CAUSAL and a PositionMask, documents
  included (the kernels' segment ids), not an arbitrary boolean tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Optional, Union

import torch

from megalite.attention.variant import visible

Tensor = torch.Tensor
Backend = Literal["torch", "triton"]
CAUSAL: Final = "causal"


@dataclass(frozen=True)
class PositionMask:
    """Causal attention in global token positions: key j is visible to query i iff 0 <= query[i] - key[j], and
    < window when there is one (a sliding-window layer, variant.py's convention), and, under document masking,
    both tokens are in the same document (`docs`). The all-gather form's mask, whose keys are every rank's zigzag
    chunks (not in position order), and any block a window or the documents cut into. Both backends take it (the
    flash kernels as positions and segment ids, skipping the tiles it leaves empty)."""

    query: Tensor  # [sq] integer positions of the query rows
    key: Tensor    # [sk] integer positions of the keys
    window: int | None = None
    docs: tuple[Tensor, Tensor] | None = None  # (query rows' [b, sq], keys' [b, sk]) integer document ids >= 0

    def keep(self) -> Tensor:
        """[sq, sk] bool, or [b, sq, sk] under documents."""
        pos = visible(self.query, self.key, self.window)
        if self.docs is None:
            return pos
        query_docs, key_docs = self.docs
        return pos & (query_docs[:, :, None] == key_docs[:, None, :])  # context/documents.py's same-document rule


@dataclass(frozen=True)
class Scores:
    """How a block's logits are formed from q k^T: the softmax scale, then the soft-cap c tanh(s / c) if any."""

    scale: float
    softcap: float | None = None


def as_scores(scores: Scores | float) -> Scores:
    """A bare float is the softmax scale of plain scores."""
    return scores if isinstance(scores, Scores) else Scores(float(scores))


# Which keys each query row sees: None = all of them; CAUSAL = key i <= query i (square blocks: the
# diagonal block of ring attention); a PositionMask (with documents too); a bool tensor [sq, sk] or [b, sq, sk] =
# any mask (torch backend only).
# Any other string is refused at run time (typed `str` so that `CAUSAL if ... else None` passes as it is).
Mask = Optional[Union[Tensor, str, PositionMask]]


def _is_causal(keep: Mask) -> bool:
    if isinstance(keep, str) and keep != CAUSAL:
        raise ValueError(f"block attention mask {keep!r}: expected None, {CAUSAL!r}, a PositionMask or a bool tensor")
    return isinstance(keep, str)


def _use_flash(backend: Backend) -> bool:
    if backend not in ("torch", "triton"):
        raise ValueError(f"block attention backend {backend!r}: expected 'torch' or 'triton' (resolve 'auto' first)")
    return backend == "triton"


def _mask_scores(s: Tensor, keep: Mask) -> Tensor:
    """-inf where `keep` excludes the key, in place."""
    if _is_causal(keep):
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    elif isinstance(keep, (PositionMask, Tensor)):  # [sq, sk], or [b, sq, sk] (documents: one per sequence)
        mask = keep.keep() if isinstance(keep, PositionMask) else keep
        s.masked_fill_(~(mask if mask.dim() == 2 else mask[:, None, None]), float("-inf"))
    return s


def _scores(q: Tensor, k: Tensor, scores: Scores, keep: Mask) -> tuple[Tensor, Tensor | None]:
    """(S, tanh) in fp32, [b, hk, rep, sq, sk]: S = scale q k^T (soft-capped: c tanh(scale q k^T / c), and then
    the tanh too, for the backward's 1 - tanh^2), -inf where `keep` excludes the key."""
    s = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)).mul_(scores.scale)
    t = None
    if scores.softcap is not None:
        t = s.div_(scores.softcap).tanh_()
        s = t * scores.softcap
    return _mask_scores(s, keep), t


def block_forward(q: Tensor, k: Tensor, v: Tensor, scores: Scores | float, keep: Mask,
                  backend: Backend = "torch") -> tuple[Tensor, Tensor]:
    """(O, L) of softmax(S, masked to `keep`) v with S = scale q k^T (soft-capped by `scores`; a float: the
    scale): O fp32 [b, hk, rep, sq, d], L fp32 [b, hk, rep, sq]. A query row that keeps no key (a document mask
    or a window can cut one off a whole block) gets O = 0, L = -inf, which the merge ignores."""
    scores = as_scores(scores)
    if _use_flash(backend):
        return _flash_forward(q, k, v, scores, keep)
    s, _ = _scores(q, k, scores, keep)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp_()  # exp(-inf - 0) = 0 on a row with no key
    return torch.matmul(p, v.float().unsqueeze(2)), lse


def block_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, lse_delta: tuple[Tensor, Tensor],
                   scores: Scores | float, keep: Mask, backend: Backend = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """(dQ [b, hk, rep, sq, d], dK [b, hk, sk, d], dV [b, hk, sk, d]), fp32, of this block's share of the
    attention, given the *final* L and D = rowsum(dO * O) of the query rows, `lse_delta` = (L, D) (see the
    module doc)."""
    lse, delta = lse_delta
    scores = as_scores(scores)
    if _use_flash(backend):
        return _flash_backward(q, k, v, d_out, lse, delta, scores, keep)
    s, tanh = _scores(q, k, scores, keep)
    p = s.sub_(lse.unsqueeze(-1)).exp_()                                    # masked entries: exp(-inf) = 0
    d_out = d_out.float()
    dv = torch.matmul(p.transpose(-1, -2), d_out).sum(dim=2)                 # summed over the rep query heads
    dp = torch.matmul(d_out, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p.mul_(dp.sub_(delta.unsqueeze(-1)))
    if tanh is not None:                                                    # through c tanh(x / c): 1 - tanh^2
        ds.mul_(tanh.square_().neg_().add_(1.0))
    dq = torch.matmul(ds, k.float().unsqueeze(2)).mul_(scores.scale)
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).sum(dim=2).mul_(scores.scale)
    return dq, dk, dv


# ---------------------------------------------------------------- the Triton backend
# The kernels take [batch, seq, heads, head_dim] with any strides (unit last): the grouped tensors here
# are passed as views (query heads hk * rep in kv-head-major order, as the kernels' h // rep expects) and
# the kernels' heads-first fp32 outputs come back as views too, so no copy is made either way.


def _flash_mask(keep: Mask, scores: Scores) -> dict[str, Any]:
    """The kernels' mask and score arguments (`causal`, `positions`, `window`, `segments`, `softcap`) for `keep`."""
    if isinstance(keep, Tensor):
        raise ValueError("the triton block backend takes the masks None, CAUSAL and PositionMask, not a mask "
                         "tensor; use backend='torch' for arbitrary masks")
    if isinstance(keep, PositionMask):
        return dict(causal=False, positions=(keep.query, keep.key), window=keep.window, segments=keep.docs,
                    softcap=scores.softcap)
    return dict(causal=_is_causal(keep), positions=None, window=None, segments=None, softcap=scores.softcap)


def _seq_major(x: Tensor) -> Tensor:
    """[b, hk, rep, s, d] or [b, hk, s, d] -> a [b, s, heads, d] view."""
    return (x.flatten(1, 2) if x.dim() == 5 else x).transpose(1, 2)


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """A [b, s, hk * rep, ...] view of heads-first memory -> [b, hk, rep, s, ...] (inverse of `_seq_major`)."""
    return x.transpose(1, 2).unflatten(1, (kv_heads, -1))


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scores: Scores, keep: Mask) -> tuple[Tensor, Tensor]:
    import megalite.kernels as kernels  # importing it does not import Triton

    out, lse = kernels.flash_attention_block(_seq_major(q), _seq_major(k), _seq_major(v),
                                             softmax_scale=scores.scale, **_flash_mask(keep, scores))
    return _grouped(out, q.shape[1]), lse.unflatten(1, (q.shape[1], -1))


def _flash_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, scores: Scores,
                    keep: Mask) -> tuple[Tensor, Tensor, Tensor]:
    import megalite.kernels as kernels

    dq, dk, dv = kernels.flash_attention_block_backward(
        _seq_major(q), _seq_major(k), _seq_major(v), _seq_major(d_out), lse.flatten(1, 2), delta.flatten(1, 2),
        softmax_scale=scores.scale, **_flash_mask(keep, scores))
    return _grouped(dq, q.shape[1]), dk.transpose(1, 2), dv.transpose(1, 2)


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (O_j, L_j) into the running (O, L) of the same query rows, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new_lse).exp_().unsqueeze(-1)).add_(block_out * (block_lse - new_lse).exp_().unsqueeze(-1))
    lse.copy_(new_lse)


def to_grouped(x: Tensor, kv_heads: int) -> Tensor:
    """[b, s, h, d] -> [b, kv_heads, h // kv_heads, s, d] (a copy, contiguous)."""
    b, s, h, d = x.shape
    return x.transpose(1, 2).reshape(b, kv_heads, h // kv_heads, s, d).contiguous()


def from_grouped(x: Tensor) -> Tensor:
    """Inverse of `to_grouped`: [b, hk, rep, s, d] -> [b, s, hk * rep, d]."""
    b, hk, rep, s, d = x.shape
    return x.reshape(b, hk * rep, s, d).transpose(1, 2).contiguous()


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Every block merged, the sinks into each row's denominator (module doc): (O', L') from the grouped (O, L)
    and the sink logits [hk * rep] (query heads in order). A row that saw no key keeps O' = 0."""
    b, hk, rep, sq = lse.shape
    sink = sinks.detach().float().view(1, hk, rep, 1)
    new_lse = torch.logaddexp(lse, sink)
    return out * (lse - new_lse).exp_().unsqueeze(-1), new_lse


def sink_grad(lse: Tensor, delta: Tensor, sinks: Tensor) -> Tensor:
    """d sink [hk * rep] from the final L' and D' = rowsum(dO O') of this rank's rows: -sum exp(sink - L') D'.
    A partial sum when the rows are split over ranks (context parallelism): the gradient reduction over dp x cp
    adds the ranks' partials, as it does for every weight's."""
    b, hk, rep, sq = lse.shape
    sink = sinks.detach().float().view(1, hk, rep, 1)
    return (sink - lse).exp_().mul_(delta).sum(dim=(0, 3)).neg_().flatten().to(sinks.dtype)
