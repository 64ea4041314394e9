"""Plain-torch references of `flash_attention.py` (and the block kernels' masks): materialised fp32 scores."""

from __future__ import annotations

import torch

from .flash_attention import Positions, _check, _scale


def _reference_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float | None,
                      positions: Positions = None) -> torch.Tensor:
    """scale * Q K^T in fp32, [B, Hq, SQ, SK], -inf where a key is masked."""
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)                                   # [B, Hq, SQ, D]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * _scale(q, softmax_scale)
    if causal:
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if positions is not None:
        scores = scores.masked_fill(positions[0][:, None] < positions[1][None, :], float("-inf"))
    return scores


def _reference_values(v: torch.Tensor, group: int) -> torch.Tensor:
    return v.float().repeat_interleave(group, dim=2).transpose(1, 2)


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                              softmax_scale: float | None = None, segments: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """Materialised attention in fp32 (S x S scores), output in q.dtype; `segments` as `flash_attention`."""
    _check(q, k, v)
    scores = _reference_scores(q, k, causal, softmax_scale)
    if segments is not None:
        scores = scores.masked_fill((segments[:, :, None] != segments[:, None, :])[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ _reference_values(v, q.shape[2] // k.shape[2])).transpose(1, 2).to(q.dtype)
