"""Plain-torch references of `flash_attention.py` (and the block kernels' masks): materialised fp32 scores."""

from __future__ import annotations

import torch

from .flash_attention import Positions, _check, _scale
from .flash_attention_variant import Variant


def _reference_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float | None,
                      positions: Positions = None, variant: Variant = Variant()) -> torch.Tensor:
    """scale * Q K^T in fp32 (soft-capped: c tanh(. / c)), [B, Hq, SQ, SK], -inf where a key is masked (causal or
    positions, and the window)."""
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)                                   # [B, Hq, SQ, D]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * _scale(q, softmax_scale)
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    if causal:
        positions = (torch.arange(q.shape[1], device=q.device), torch.arange(k.shape[1], device=q.device))
    if positions is not None:
        diff = positions[0][:, None] - positions[1][None, :]
        hidden = (diff < 0) | (diff >= variant.window) if variant.window is not None else diff < 0
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _reference_values(v: torch.Tensor, group: int) -> torch.Tensor:
    return v.float().repeat_interleave(group, dim=2).transpose(1, 2)


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                              softmax_scale: float | None = None, segments: torch.Tensor | None = None,
                              window: int | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Materialised attention in fp32 (S x S scores), output in q.dtype; the arguments as `flash_attention`'s
    (the sinks: one more column of logits per head, dropped after the softmax)."""
    _check(q, k, v)
    scores = _reference_scores(q, k, causal, softmax_scale, variant=Variant(window, softcap))
    if segments is not None:
        scores = scores.masked_fill((segments[:, :, None] != segments[:, None, :])[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        p = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        p = scores.softmax(dim=-1)
    return (p @ _reference_values(v, q.shape[2] // k.shape[2])).transpose(1, 2).to(q.dtype)
