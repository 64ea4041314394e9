"""Attention of whole sequences in position order under a variant, on one context-parallel rank (cp = 1).

The entry the model calls for a non-plain variant (megalite/model/attend.py); plain causal attention keeps
the backend's own kernel. Today: the reference math of variant.py (an [S, S] score matrix per head)."""

from __future__ import annotations

import torch

from megalite.attention.variant import AttentionVariant, reference_attention

Tensor = torch.Tensor


def variant_attention(q: Tensor, k: Tensor, v: Tensor, variant: AttentionVariant,
                      docs: Tensor | None = None, backend: str = "torch") -> Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hk, D] -> [B, S, Hq, D]; `docs` [B, S] document ids (document masking) or None.
    `backend` is the resolved model.kernels ('torch' or 'triton')."""
    pos = torch.arange(q.shape[1], device=q.device)
    return reference_attention(q, k, v, variant, pos, pos, docs, docs)
