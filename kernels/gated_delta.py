"""The gated delta rule's chunk kernel (Gated DeltaNet, arXiv 2412.06464): the chunked form of
megalite/recurrent/chunked.py in one Triton program per (sequence, value head).

The program keeps the state S [K, V] in registers and walks the chunks in order; per chunk of BT tokens it
loads q, k, v, g, beta and the document ids, and computes (masks as in the torch form: `seen` = same document
and j <= i, `first` = still in the state's document, `tail` = in the chunk's last document):

    D = exp(cum_i - cum_j) [seen]                    A = (beta k k^T) D, strictly lower
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...        the Neumann series of a nilpotent matrix, grouped as
                                                     log2(BT) matrix products (A^BT = 0): tensor-core work
                                                     where a forward substitution would be BT dependent rows
    U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k exp(cum) [first])
    V' = U - W S
    O = scale (q exp(cum) [first]) S + scale (q k^T D) V'
    S = exp(cum_last) [first_last] S + (k exp(cum_last - cum) [tail])^T V'

Every exponent is <= 0 (g <= 0 and masked pairs never exponentiated), so nothing overflows. The scalar decay
with the erase only (Gated DeltaNet); the other gates run the torch forms.

Backward: not a Triton kernel yet. `ChunkGatedDelta.backward` recomputes the forward with the differentiable
torch chunked form it is given and back-propagates through it (torch autograd), so the gradients are the
chunked form's, exactly; the cost is a second forward in torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ._triton import jit, next_power_of_2, tl  # lazy stand-ins (see _triton.py)

Tensor = torch.Tensor
TorchForm = Callable[..., tuple[Tensor, Tensor]]


@jit
def _gated_delta_fwd_kernel(Q, K, V, G, BETA, DOC, H0, O, HT, T, H, scale,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    rk, rv, rt = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    mk, mv = rk < DK, rv < DV
    state_offs = (b * H + h).to(tl.int64) * DK * DV + rk[:, None] * DV + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    S = tl.load(H0 + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    causal = rt[:, None] >= rt[None, :]
    strict = rt[:, None] > rt[None, :]
    eye = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)
    for c in range(0, tl.cdiv(T, BT)):
        t0 = c * BT
        offs = t0 + rt
        mt = offs < T
        row = ((b * T + offs) * H + h).to(tl.int64)
        q = tl.load(Q + row[:, None] * DK + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        k = tl.load(K + row[:, None] * DK + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + row[:, None] * DV + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        g = tl.load(G + row, mask=mt, other=0.0).to(tl.float32)
        beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
        doc = tl.load(DOC + b * T + tl.minimum(offs, T - 1))          # padded tokens: the last one's document
        state_doc = tl.load(DOC + b * T + tl.maximum(t0 - 1, 0))     # the document of the state entering
        cum = tl.cumsum(g, 0)
        seen = (doc[:, None] == doc[None, :]) & causal
        decay = tl.where(seen, tl.exp(tl.where(seen, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kb = k * beta[:, None]
        neg_a = tl.where(strict, -tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        inv = eye + neg_a
        power = neg_a
        for _ in tl.static_range(LOG2_BT - 1):
            power = tl.dot(power, power, input_precision=PREC)
            inv = inv + tl.dot(inv, power, input_precision=PREC)
        e_first = tl.where(doc == state_doc, tl.exp(cum), 0.0)
        cum_last = tl.sum(tl.where(rt == BT - 1, cum, 0.0), 0)      # padded g = 0: the last real token's
        doc_last = tl.max(doc, 0)                                    # documents never decrease
        e_tail = tl.where(doc == doc_last, tl.exp(cum_last - cum), 0.0)
        u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
        w = tl.dot(inv, kb * e_first[:, None], input_precision=PREC)
        written = u - tl.dot(w, S, input_precision=PREC)
        qk = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)
        o = scale * (tl.dot(q * e_first[:, None], S, input_precision=PREC)
                     + tl.dot(qk, written, input_precision=PREC))
        tl.store(O + row[:, None] * DV + rv[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        carried = tl.where(doc_last == state_doc, tl.exp(cum_last), 0.0)
        S = S * carried + tl.dot(tl.trans(k * e_tail[:, None]), written, input_precision=PREC)
    tl.store(HT + state_offs, S, mask=state_mask)


def chunk_gated_delta_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor,
                          initial_state: Tensor, scale: float, chunk_size: int) -> tuple[Tensor, Tensor]:
    """(o [B, T, H, V], final state [B, H, K, V] fp32) for q, k [B, T, H, K] (key heads already expanded to
    the value heads), g, beta [B, T, H], doc_ids [B, T], initial_state [B, H, K, V]."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size}: the kernel takes a power of two >= 16")
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    final = torch.empty(b, h, dk, dv, dtype=torch.float32, device=v.device)
    prec = "ieee" if v.dtype == torch.float32 else "tf32"
    _gated_delta_fwd_kernel[(b * h,)](
        q, k, v, g, beta, doc_ids.long().contiguous(), initial_state.float().contiguous(), o, final, t, h, scale,
        DK=dk, DV=dv, BK=max(16, next_power_of_2(dk)), BV=max(16, next_power_of_2(dv)), BT=chunk_size,
        LOG2_BT=chunk_size.bit_length() - 1, PREC=prec, num_warps=4)
    return o, final


class ChunkGatedDelta(torch.autograd.Function):
    """The kernel's forward; the backward through `torch_form` (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # type: ignore[override]
                initial_state: Tensor, doc_ids: Tensor, scale: float, chunk_size: int,
                torch_form: TorchForm) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(q, k, v, g, beta, initial_state, doc_ids)
        ctx.scale, ctx.chunk_size, ctx.torch_form = scale, chunk_size, torch_form
        return chunk_gated_delta_fwd(q, k, v, g, beta, doc_ids, initial_state, scale, chunk_size)

    @staticmethod
    def backward(ctx: Any, d_o: Optional[Tensor], d_state: Optional[Tensor]  # type: ignore[override]
                 ) -> tuple[Optional[Tensor], ...]:
        q, k, v, g, beta, initial_state, doc_ids = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, initial_state)]
        with torch.enable_grad():
            o, final = ctx.torch_form(*inputs[:5], doc_ids=doc_ids, scale=ctx.scale, initial_state=inputs[5],
                                      chunk_size=ctx.chunk_size)
            outs = [(x, dx) for x, dx in ((o, d_o), (final, d_state)) if dx is not None]
            grads = torch.autograd.grad([x for x, _ in outs], inputs, [dx for _, dx in outs], allow_unused=True)
        return (*grads, None, None, None, None)
