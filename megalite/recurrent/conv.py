"""The short causal depthwise convolution in front of the recurrence, and the gated RMSNorm behind it.

The convolution (kernel W, 4 in Qwen3.5) mixes each channel over the last W tokens:
    y_t = sum_{s=0}^{W-1} weight[:, W-1-s] * x_{t-s}
(transformers' `F.conv1d(x, weight, padding=W-1, groups=channels)[..., :T]`). A token reads x_{t-s} only from
its own document: packed documents see zeros before their first token, exactly as if each ran alone, so the
window, like the recurrent state, restarts at every EOD. In generation its state is the last W-1 inputs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def causal_conv(x: Tensor, weight: Tensor, doc_ids: Optional[Tensor], past: Optional[Tensor] = None,
                past_doc_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(y [B, T, C], the conv state after the last token [B, W-1, C]) for x [B, T, C], weight [C, W]; `past`
    [B, W-1, C] the inputs before x (generation, or the previous cp slice's last ones), else zeros; their
    documents `past_doc_ids` [B, W-1] (default: token 0's)."""
    b, t, c = x.shape
    width = weight.shape[1]
    if past is None:
        past = x.new_zeros(b, width - 1, c)
    full = torch.cat([past.to(x.dtype), x], dim=1)                     # [B, W-1+T, C]
    ids = torch.zeros(b, t, dtype=torch.long, device=x.device) if doc_ids is None else doc_ids
    before = ids[:, :1].expand(b, width - 1) if past_doc_ids is None else past_doc_ids
    docs = torch.cat([before, ids], dim=1)
    y = x.new_zeros(b, t, c)
    for s in range(width):
        window = full[:, width - 1 - s:width - 1 - s + t]               # x_{t-s}, where in t's document
        own = (docs[:, width - 1 - s:width - 1 - s + t] == ids)[..., None]
        y = y + torch.where(own, window, 0.0) * weight[:, width - 1 - s].to(x.dtype)
    # The next token continues the last document: inputs of earlier documents are not in its window.
    state = torch.where((docs[:, -(width - 1):] == ids[:, -1:])[..., None], full[:, -(width - 1):], 0.0)
    return y, state


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (flash-linear-attention's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float,
                   activation: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """RMSNorm(x) * weight * activation(gate) over the last dim (each head's values), in fp32, back in x's dtype
    (Qwen3.5's Gated DeltaNet: silu; Kimi Delta Attention: sigmoid)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * activation(gate.float())).to(x.dtype)
