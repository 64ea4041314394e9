"""The gated delta rule, one token at a time: the definition every other form is tested against.

Per head, with a state S [K, V] (keys index its rows, values its columns, as flash-linear-attention and
transformers' Qwen3-Next / Qwen3.5 lay it out), at each token t:

    S <- 0                                   if t starts a document (packing: no state crosses an EOD)
    S <- exp(g_t) * S                        decay: g_t [H] (scalar per head) or [H, K] (per key channel)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T    the delta rule's write (erase=True)
    S <- S + k_t (beta_t * v_t)^T                a plain decayed write (erase=False)
    o_t = scale * S^T q_t

One recurrence, three gates (arXiv 2412.06464, 2510.26692, 2405.21060):

    Gated DeltaNet (Qwen3.5, Qwen3-Next)   scalar decay,      erase
    Kimi Delta Attention (Kimi Linear)     per-channel decay, erase
    Mamba2 SSD (Nemotron-H)                scalar decay,      no erase

Shapes: q, k [B, T, Hk, K]; v [B, T, H, V] with H a multiple of Hk (value head h reads key head h // (H/Hk), as
transformers' `repeat_interleave`); g [B, T, H] or [B, T, H, K] (log decay, <= 0); beta [B, T, H]; the state
[B, H, K, V]. `doc_ids` [B, T] (non-decreasing, megalite.context.documents' ids) mark the documents: a token
whose id differs from its predecessor's starts from a zero state; the first token continues `initial_state`.
`doc_ids` is a required keyword of every form, so that a caller must say whether the batch is packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class RuleInputs:
    """The per-token inputs of the recurrence (shapes in the module doc)."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor

    def check(self, doc_ids: Optional[Tensor]) -> None:
        """One line naming what is wrong with the shapes."""
        check_inputs(self.q, self.k, self.v, self.g, self.beta, doc_ids)


@dataclass(frozen=True)
class Gate:
    """Which recurrence: the decay's shape and whether the write erases what the state predicts."""

    name: str
    per_channel_decay: bool
    erase: bool


GATED_DELTANET = Gate("gated_deltanet", per_channel_decay=False, erase=True)
KIMI_DELTA = Gate("kimi_delta", per_channel_decay=True, erase=True)
MAMBA2_SSD = Gate("mamba2_ssd", per_channel_decay=False, erase=False)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Optional[Tensor]) -> None:
    """One line naming what is wrong with the engine's inputs."""
    b, t, hk, dk = k.shape
    h = v.shape[2]
    if q.shape != k.shape or v.shape[:2] != (b, t) or h % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must match and "
                         "v's heads must be a multiple of k's")
    if g.shape not in ((b, t, h), (b, t, h, dk)) or beta.shape != (b, t, h):
        raise ValueError(f"g {tuple(g.shape)} must be [B, T, H] or [B, T, H, K] and beta {tuple(beta.shape)} "
                         f"[B, T, H] for v {tuple(v.shape)}")
    if doc_ids is not None and doc_ids.shape != (b, t):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [B, T] = {(b, t)}")


def expand_groups(x: Tensor, heads: int) -> Tensor:
    """q or k [B, T, Hk, K] -> [B, T, H, K]: each key head serves H/Hk consecutive value heads."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def document_starts(doc_ids: Optional[Tensor]) -> Optional[Tensor]:
    """[B, T] bool, True where a token's document differs from its predecessor's (token 0: False)."""
    if doc_ids is None:
        return None
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def working_dtype(v: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the recurrence is never computed in a 16-bit type."""
    return torch.promote_types(v.dtype, torch.float32)


def zero_state(v: Tensor, k_dim: int) -> Tensor:
    b, _, h, dv = v.shape
    return torch.zeros(b, h, k_dim, dv, dtype=working_dtype(v), device=v.device)


def recurrent_gated_delta(x: RuleInputs, *, doc_ids: Optional[Tensor], scale: float,
                          initial_state: Optional[Tensor] = None, erase: bool = True) -> tuple[Tensor, Tensor]:
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] in `working_dtype`), one token at a time."""
    x.check(doc_ids)
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    h, out_dtype, work = v.shape[2], v.dtype, working_dtype(v)
    q, k = (expand_groups(y, h).to(work) for y in (q, k))
    v, g, beta = v.to(work), g.to(work), beta.to(work)
    state = zero_state(v, k.shape[-1]) if initial_state is None else initial_state.to(work)
    starts = document_starts(doc_ids)
    outputs = []
    for t in range(v.shape[1]):
        if starts is not None:
            state = torch.where(starts[:, t, None, None, None], torch.zeros_like(state), state)
        decay = g[:, t].exp()
        state = state * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        k_t = k[:, t]
        write = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t) if erase else v[:, t]
        state = state + k_t[..., None] * (beta[:, t, :, None] * write)[..., None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1).to(out_dtype), state
