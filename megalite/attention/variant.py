"""An attention variant and its reference math.

A variant is what a layer's attention computes beyond softmax(q k^T / sqrt(d)) v under the causal mask:
- `window`: sliding-window attention. Query i sees key j iff i - window < j <= i: `window` keys counting the
  query's own (transformers' `sliding_window` convention, gpt-oss and Gemma 2/3; Mistral's too).
- `softcap`: the logits pass through softcap * tanh(logits / softcap) after scaling (Gemma 2).
- `scale`: the softmax scale; None = 1 / sqrt(head_dim) (Gemma's query_pre_attn_scalar gives its own).
- `sinks`: a learnable logit per query head added to each row's softmax denominator and dropped from the output
  (gpt-oss): p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)). This rank's heads, in the query heads' order.

`reference_attention` is the definition, written for reading: every other path (SDPA, the flash kernel, each
context-parallel mode) is held to it by tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttentionVariant:
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: Tensor | None = None  # [local query heads], the sink logits (a parameter: gradients flow to it)

    @property
    def is_plain(self) -> bool:
        """Causal softmax attention at 1/sqrt(d): what every path computed before variants existed."""
        return self.window is None and self.softcap is None and self.scale is None and self.sinks is None

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


PLAIN = AttentionVariant()


def variant_heads(variant: AttentionVariant, group: int, groups: int) -> AttentionVariant:
    """The variant of query-head group `group` of `groups` equal groups (a2a context parallelism attends for a
    group of the heads): its sinks are the group's slice (a view: their gradient flows back to those heads)."""
    if variant.sinks is None:
        return variant
    n = variant.sinks.shape[0] // groups
    return replace(variant, sinks=variant.sinks[group * n:(group + 1) * n])


def visible(query_pos: Tensor, key_pos: Tensor, window: int | None) -> Tensor:
    """[sq, sk] bool: key j visible to query i by position alone (causal, and within the window if any)."""
    diff = query_pos[:, None] - key_pos[None, :]
    keep = diff >= 0
    if window is not None:
        keep &= diff < window
    return keep


def reference_attention(q: Tensor, k: Tensor, v: Tensor, variant: AttentionVariant, query_pos: Tensor,
                        key_pos: Tensor, query_docs: Tensor | None = None, key_docs: Tensor | None = None
                        ) -> Tensor:
    """q [B, sq, Hq, D], k/v [B, sk, Hk, D] -> [B, sq, Hq, D] in q's dtype, computed in fp32.

    Query head h reads kv head h // (Hq / Hk). Positions are global token positions ([sq], [sk]); with
    document ids ([B, sq], [B, sk]) a key is visible only within its query's document as well. A row that sees
    no key (possible only with a sink) outputs zeros."""
    rep = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(rep, dim=2)
    vf = v.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * variant.softmax_scale(q.shape[-1])
    if variant.softcap is not None:
        s = variant.softcap * torch.tanh(s / variant.softcap)
    keep = visible(query_pos, key_pos, variant.window)[None, None]
    if query_docs is not None and key_docs is not None:
        keep = keep & (query_docs[:, :, None] == key_docs[:, None, :])[:, None]
    s = s.masked_fill(~keep, float("-inf"))
    if variant.sinks is not None:
        b, h, sq, _ = s.shape
        sink = variant.sinks.float().view(1, h, 1, 1).expand(b, h, sq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype)
