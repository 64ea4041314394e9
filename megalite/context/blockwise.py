"""Attention of a block of queries against a block of keys, returning the log-sum-exp, in plain torch.

The building block of ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers") and
of flash attention (Dao et al. 2022): a query row's softmax over several key blocks is recovered exactly
from each block's output O_j and log-sum-exp L_j (the online softmax, Milakov & Gimelshein 2018):

    L = log(sum_j exp(L_j)),   O = sum_j exp(L_j - L) O_j

and the backward needs, per block, only the final L and D = rowsum(dO * O):

    P = exp(S - L),  dV = P^T dO,  dS = P * (dO V^T - D),  dQ = scale dS K,  dK = scale dS^T Q.

Layout: heads first, grouped for GQA. q is [b, hk, rep, sq, d] (query head h = kv_head * rep + i reads
kv head h // rep, as in megalite.model.ops.attention), k/v are [b, hk, sk, d]; L and D are
[b, hk, rep, sq]. Everything is computed in fp32 whatever the input dtype. This is the readable
reference: it materialises the [sq, sk] scores of one block pair (a flash kernel returning its LSE would
not).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _scores(q: Tensor, k: Tensor, scale: float, keep: Tensor | None) -> Tensor:
    """scale * q k^T in fp32, [b, hk, rep, sq, sk]; -inf where `keep` ([sq, sk] bool) is False."""
    s = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if keep is not None:
        s.masked_fill_(~keep, float("-inf"))
    return s


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """(O, L) of softmax(scale q k^T, masked to `keep`) v: O fp32 [b, hk, rep, sq, d], L fp32 [b, hk, rep, sq].
    Every query row must keep at least one key (true of the causal blocks ring attention computes)."""
    s = _scores(q, k, scale, keep)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(p, v.float().unsqueeze(2)), lse


def block_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, scale: float,
                   keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ [b, hk, rep, sq, d], dK [b, hk, sk, d], dV [b, hk, sk, d]), fp32, of this block's share of the
    attention, given the *final* L and D = rowsum(dO * O) of the query rows (see the module doc)."""
    s = _scores(q, k, scale, keep)
    p = s.sub_(lse.unsqueeze(-1)).exp_()                                    # masked entries: exp(-inf) = 0
    d_out = d_out.float()
    dv = torch.matmul(p.transpose(-1, -2), d_out).sum(dim=2)                 # summed over the rep query heads
    dp = torch.matmul(d_out, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p.mul_(dp.sub_(delta.unsqueeze(-1)))
    dq = torch.matmul(ds, k.float().unsqueeze(2)).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).sum(dim=2).mul_(scale)
    return dq, dk, dv


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
