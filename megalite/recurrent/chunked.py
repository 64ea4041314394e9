"""The gated delta rule by chunks (the WY / UT transform: Yang et al., arXiv 2406.06484 and 2412.06464), in torch.

The sequence is cut into chunks of C tokens (zero-padded to a multiple of C: a padded token has k = v = beta = 0,
g = 0 and its predecessor's document, so it changes nothing). Per chunk and head, with S the state entering it
[K, V] and cum_i = g_1 + ... + g_i the decay accumulated from the chunk's start to token i (per key channel
when the decay is):

    same_ij   token j's document is token i's          (the packing mask: no pair crosses an EOD)
    first_i   token i is still in the document of S     (no document starts at or before i in the chunk)
    D_ij      exp(cum_i - cum_j) where same_ij and j <= i, else 0            [C, C] (per channel: [C, C, K])
    A_ij      beta_i k_i . k_j D_ij for j < i                                 the delta rule's coupling
    (I + A) U = beta v,  (I + A) W = beta k exp(cum) [first]                  one triangular solve, [C, V], [C, K]
    V' = U - W S                                  the values actually written (the erase of S's prediction)
    O  = scale * ((q exp(cum) [first]) S + (q k^T D) V')                      read of S + within the chunk
    S' = exp(cum_C) [first_C] S + (k exp(cum_C - cum) [same doc as token C])^T V'

Without the erase (erase=False, Mamba2's SSD) there is nothing to solve: V' = beta v. The per-channel decay
(Kimi Delta Attention) keeps D as [C, C, K] and contracts it with the keys (an einsum, not a matmul): exact
and stable (every exponent is <= 0), at C times the memory; a kernel would sub-chunk instead.
docs/linear-attention.md derives each line with its shapes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megalite.recurrent.recurrence import RuleInputs, expand_groups, working_dtype, zero_state

Tensor = torch.Tensor
CHUNK = 64


def chunk_documents(doc_ids: Optional[Tensor], batch: int, length: int, chunk: int, device: torch.device
                    ) -> tuple[Tensor, Tensor]:
    """(docs [B, 1, N, C]: each token's document, padded with the last one; state_docs [B, 1, N]: the
    document of the state entering each chunk, i.e. of the token before it, token 0's for the first)."""
    docs = torch.zeros(batch, length, dtype=torch.long, device=device) if doc_ids is None else doc_ids.long()
    pad = (-length) % chunk
    docs = torch.cat([docs, docs[:, -1:].expand(batch, pad)], dim=1)
    before = torch.cat([docs[:, :1], docs[:, :-1]], dim=1)
    return docs.view(batch, 1, -1, chunk), before[:, ::chunk].view(batch, 1, -1)


def to_chunks(x: Tensor, chunk: int) -> Tensor:
    """[B, T, H, *] -> [B, H, N, C, *], zero-padded along T."""
    pad = (-x.shape[1]) % chunk
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def chunked_gated_delta(x: RuleInputs, *, doc_ids: Optional[Tensor], scale: float,
                        initial_state: Optional[Tensor] = None, erase: bool = True, chunk_size: int = CHUNK
                        ) -> tuple[Tensor, Tensor]:
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] in `working_dtype`): `recurrent_gated_delta` by chunks."""
    x.check(doc_ids)
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    b, t, h, _ = v.shape
    out_dtype, work, c = v.dtype, working_dtype(v), chunk_size
    state = zero_state(v, k.shape[-1]) if initial_state is None else initial_state.to(work)
    q, k = (to_chunks(expand_groups(y, h).to(work), c) for y in (q, k))
    v, g, beta = (to_chunks(y.to(work), c) for y in (v, g, beta))
    docs, state_docs = chunk_documents(doc_ids, b, t, c, v.device)
    per_channel = g.dim() == 5

    def per_key(x: Tensor) -> Tensor:  # a per-token factor [.., C] or [.., C, K], made to scale rows of k
        return x if per_channel else x[..., None]

    def like_cum(mask: Tensor) -> Tensor:  # a per-token mask [.., C], made to select entries of cum
        return mask[..., None] if per_channel else mask

    cum = g.cumsum(dim=3)                                                   # [B, H, N, C(, K)]
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    strict = causal.tril(-1)
    seen = (docs[..., :, None] == docs[..., None, :]) & causal               # [B, 1, N, C, C]
    if per_channel:
        diff = cum[..., :, None, :] - cum[..., None, :, :]                   # [B, H, N, C, C, K]
        decay = diff.masked_fill(~seen[..., None], float("-inf")).exp()
        pair: Callable[[Tensor, Tensor], Tensor] = lambda a, z: torch.einsum("...ik,...jk,...ijk->...ij", a, z, decay)
    else:
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~seen, float("-inf")).exp()
        pair = lambda a, z: (a @ z.transpose(-1, -2)) * decay
    first = docs == state_docs[..., None]                                    # [B, 1, N, C]
    tail = docs == docs[..., -1:]
    e_first = torch.where(like_cum(first), cum.exp(), 0.0)                  # decay from the chunk's start
    e_tail = torch.where(like_cum(tail), (cum[:, :, :, -1:] - cum).exp(), 0.0)  # decay to the chunk's end
    state_decay = torch.where(like_cum(first[..., -1:]), cum[:, :, :, -1:].exp(), 0.0)  # [B, H, N, 1(, K)]
    kb, vb = k * beta[..., None], v * beta[..., None]
    attn = pair(q, k)                                                        # [B, H, N, C, C], diagonal kept
    u, w = vb, None
    if erase:
        eye = torch.eye(c, dtype=work, device=v.device)
        system = eye + pair(kb, k) * strict                                  # I + A, A strictly lower
        u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * per_key(e_first), upper=False, unitriangular=True)
    outputs = []
    for n in range(q.shape[2]):
        written = u[:, :, n] if w is None else u[:, :, n] - w[:, :, n] @ state                   # [B, H, C, V]
        outputs.append(scale * ((q[:, :, n] * per_key(e_first[:, :, n])) @ state + attn[:, :, n] @ written))
        carried = state_decay[:, :, n].transpose(-1, -2) if per_channel else state_decay[:, :, n, :, None]
        state = state * carried + (k[:, :, n] * per_key(e_tail[:, :, n])).transpose(-1, -2) @ written
    o = torch.stack(outputs, dim=2).reshape(b, h, -1, v.shape[-1])[:, :, :t]
    return o.transpose(1, 2).to(out_dtype), state
