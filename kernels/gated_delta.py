"""The gated delta rule's chunk kernel (Gated DeltaNet, arXiv 2412.06464): the chunked form of
megalite/recurrent/chunked.py in one Triton program per (sequence, value head).

The program keeps the state S [K, V] in registers and walks the chunks in order; per chunk of BT tokens it
loads q, k, v, g, beta and the document ids, and computes (masks as in the torch form: `seen` = same document
and j <= i, `first` = still in the state's document, `tail` = in the chunk's last document):

    D = exp(cum_i - cum_j) [seen]                    A = (beta k k^T) D, strictly lower
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...        the Neumann series of a nilpotent matrix (A^BT = 0),
                                                     grouped as log2(BT) - 1 doublings of two products each:
                                                     tensor-core work where a forward substitution would be
                                                     BT dependent row updates
    U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k exp(cum) [first])
    V' = U - W S
    O = scale (q exp(cum) [first]) S + scale (q k^T D) V'
    S = exp(cum_last) [first_last] S + (k exp(cum_last - cum) [tail])^T V'

Every exponent is <= 0 (g <= 0 and masked pairs never exponentiated), so nothing overflows. The scalar decay
with the erase only (Gated DeltaNet); the other gates run the torch forms.

Backward: the forward saves the state entering each chunk ([N, K, V] per head); one program per (sequence,
head) walks the chunks in reverse, recomputes the chunk's terms from its saved state and carries dS back:

    dS_prev = exp(cum_last)[first_last] dS + (q e_first)^T dO' - W^T dV'            (dO' = scale dO)
    dV' = (k e_tail) dS + pair^T dO',   d inv = dV' (beta v)^T - dV' S^T (beta k e_first)^T
    dA = -inv^T (d inv) inv^T [strict],  then through A = (beta k k^T) D and pair = (q k^T) D to dq, dk, dbeta,
    and through D, e_first, e_tail and exp(cum_last) to d cum, whose reverse cumulative sum is dg.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._triton import jit, next_power_of_2, tl  # lazy stand-ins (see _triton.py)

Tensor = torch.Tensor


@jit
def _chunk_terms(Q, K, V, G, BETA, DOC, b, h, c, T, H, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """Load chunk c of sequence b, head h, and compute what the forward and the backward both need."""
    rk, rv, rt = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    t0 = c * BT
    offs = t0 + rt
    mt = offs < T
    row = ((b * T + offs) * H + h).to(tl.int64)
    q = tl.load(Q + row[:, None] * DK + rk[None, :], mask=mt[:, None] & (rk < DK)[None, :], other=0.0).to(tl.float32)
    k = tl.load(K + row[:, None] * DK + rk[None, :], mask=mt[:, None] & (rk < DK)[None, :], other=0.0).to(tl.float32)
    v = tl.load(V + row[:, None] * DV + rv[None, :], mask=mt[:, None] & (rv < DV)[None, :], other=0.0).to(tl.float32)
    g = tl.load(G + row, mask=mt, other=0.0).to(tl.float32)
    beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
    doc = tl.load(DOC + b * T + tl.minimum(offs, T - 1))          # padded tokens: the last one's document
    state_doc = tl.load(DOC + b * T + tl.maximum(t0 - 1, 0))     # the document of the state entering
    cum = tl.cumsum(g, 0)
    seen = (doc[:, None] == doc[None, :]) & (rt[:, None] >= rt[None, :])
    strict = seen & (rt[:, None] > rt[None, :])
    decay = tl.where(seen, tl.exp(tl.where(seen, cum[:, None] - cum[None, :], 0.0)), 0.0)
    kb = k * beta[:, None]
    neg_a = tl.where(strict, -tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
    inv = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0) + neg_a
    power = neg_a
    for _ in tl.static_range(LOG2_BT - 1):
        power = tl.dot(power, power, input_precision=PREC)
        inv = inv + tl.dot(inv, power, input_precision=PREC)
    e_first = tl.where(doc == state_doc, tl.exp(cum), 0.0)
    cum_last = tl.sum(tl.where(rt == BT - 1, cum, 0.0), 0)      # padded g = 0: the last real token's
    doc_last = tl.max(doc, 0)                                    # documents never decrease
    e_tail = tl.where(doc == doc_last, tl.exp(cum_last - cum), 0.0)
    carried = tl.where(doc_last == state_doc, tl.exp(cum_last), 0.0)
    return row, mt, q, k, v, beta, seen, strict, decay, inv, e_first, e_tail, carried


@jit
def _gated_delta_fwd_kernel(Q, K, V, G, BETA, DOC, H0, O, HT, STATES, T, H, scale,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    state_offs = rk[:, None] * DV + rv[None, :]
    state_mask = (rk < DK)[:, None] & (rv < DV)[None, :]
    S = tl.load(H0 + pid.to(tl.int64) * DK * DV + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    chunks = tl.cdiv(T, BT)
    for c in range(0, chunks):
        row, mt, q, k, v, beta, seen, strict, decay, inv, e_first, e_tail, carried = _chunk_terms(
            Q, K, V, G, BETA, DOC, b, h, c, T, H, DK, DV, BK, BV, BT, LOG2_BT, PREC)
        tl.store(STATES + (pid.to(tl.int64) * chunks + c) * DK * DV + state_offs, S, mask=state_mask)
        u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
        w = tl.dot(inv, k * (beta * e_first)[:, None], input_precision=PREC)
        written = u - tl.dot(w, S, input_precision=PREC)
        qk = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)
        o = scale * (tl.dot(q * e_first[:, None], S, input_precision=PREC)
                     + tl.dot(qk, written, input_precision=PREC))
        tl.store(O + row[:, None] * DV + rv[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & (rv < DV)[None, :])
        S = S * carried + tl.dot(tl.trans(k * e_tail[:, None]), written, input_precision=PREC)
    tl.store(HT + pid.to(tl.int64) * DK * DV + state_offs, S, mask=state_mask)


@jit
def _gated_delta_bwd_kernel(Q, K, V, G, BETA, DOC, STATES, DO, DHT, DQ, DK_, DV_, DG, DBETA, DH0, T, H, scale,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    rk, rv, rt = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    state_offs = rk[:, None] * DV + rv[None, :]
    state_mask = (rk < DK)[:, None] & (rv < DV)[None, :]
    dS = tl.load(DHT + pid.to(tl.int64) * DK * DV + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    chunks = tl.cdiv(T, BT)
    for i in range(0, chunks):
        c = chunks - 1 - i
        row, mt, q, k, v, beta, seen, strict, decay, inv, e_first, e_tail, carried = _chunk_terms(
            Q, K, V, G, BETA, DOC, b, h, c, T, H, DK, DV, BK, BV, BT, LOG2_BT, PREC)
        S = tl.load(STATES + (pid.to(tl.int64) * chunks + c) * DK * DV + state_offs, mask=state_mask, other=0.0)
        kmask = mt[:, None] & (rk < DK)[None, :]
        vmask = mt[:, None] & (rv < DV)[None, :]
        do = scale * tl.load(DO + row[:, None] * DV + rv[None, :], mask=vmask, other=0.0).to(tl.float32)
        # The forward again: the values written and the chunk's pair terms.
        kb, vb = k * beta[:, None], v * beta[:, None]
        kbe, qe, ket = kb * e_first[:, None], q * e_first[:, None], k * e_tail[:, None]
        w = tl.dot(inv, kbe, input_precision=PREC)
        written = tl.dot(inv, vb, input_precision=PREC) - tl.dot(w, S, input_precision=PREC)
        kk = tl.dot(kb, tl.trans(k), input_precision=PREC)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        pair = tl.where(seen, qk * decay, 0.0)
        # S' = carried S + ket^T V'  and  O = qe S + pair V' (scale folded into do).
        d_carried = tl.sum(tl.sum(S * dS, 1), 0)
        d_ket = tl.dot(written, tl.trans(dS), input_precision=PREC)
        d_written = tl.dot(ket, dS, input_precision=PREC) + tl.dot(tl.trans(pair), do, input_precision=PREC)
        d_pair = tl.where(seen, tl.dot(do, tl.trans(written), input_precision=PREC), 0.0)
        d_qe = tl.dot(do, tl.trans(S), input_precision=PREC)
        # V' = inv vb - inv kbe S, inv = (I + A)^-1: d inv = dV' vb^T - dV' S^T kbe^T, dA = -inv^T d_inv inv^T.
        d_w = -tl.dot(d_written, tl.trans(S), input_precision=PREC)
        d_inv = tl.dot(d_written, tl.trans(vb), input_precision=PREC) + tl.dot(d_w, tl.trans(kbe), input_precision=PREC)
        d_vb = tl.dot(tl.trans(inv), d_written, input_precision=PREC)
        d_kbe = tl.dot(tl.trans(inv), d_w, input_precision=PREC)
        inv_t = tl.trans(inv)
        d_a = tl.where(strict, -tl.dot(tl.dot(inv_t, d_inv, input_precision=PREC), inv_t, input_precision=PREC), 0.0)
        dS = carried * dS + tl.dot(tl.trans(qe), do, input_precision=PREC) - tl.dot(tl.trans(w), d_written,
                                                                                    input_precision=PREC)
        # A = (kb k^T) D [strict], pair = (q k^T) D [seen]; D = exp(cum_i - cum_j).
        d_ad, d_pd = d_a * decay, d_pair * decay
        d_kb = tl.dot(d_ad, k, input_precision=PREC) + d_kbe * e_first[:, None]
        dk = (tl.dot(tl.trans(d_ad), kb, input_precision=PREC) + tl.dot(tl.trans(d_pd), q, input_precision=PREC)
              + d_ket * e_tail[:, None] + d_kb * beta[:, None])
        dq = tl.dot(d_pd, k, input_precision=PREC) + d_qe * e_first[:, None]
        e = d_ad * kk + d_pd * qk
        d_cum = tl.sum(e, 1) - tl.sum(e, 0)
        d_cum += (tl.sum(d_qe * q, 1) + tl.sum(d_kbe * kb, 1)) * e_first
        d_et = tl.sum(d_ket * k, 1) * e_tail
        d_cum -= d_et
        d_cum += tl.where(rt == BT - 1, tl.sum(d_et, 0) + d_carried * carried, 0.0)
        dg = tl.sum(d_cum, 0) - tl.cumsum(d_cum, 0) + d_cum           # g_i enters every cum_j with j >= i
        dbeta = tl.sum(d_kb * k, 1) + tl.sum(d_vb * v, 1)
        tl.store(DQ + row[:, None] * DK + rk[None, :], dq.to(DQ.dtype.element_ty), mask=kmask)
        tl.store(DK_ + row[:, None] * DK + rk[None, :], dk.to(DK_.dtype.element_ty), mask=kmask)
        tl.store(DV_ + row[:, None] * DV + rv[None, :], (d_vb * beta[:, None]).to(DV_.dtype.element_ty), mask=vmask)
        tl.store(DG + row, dg.to(DG.dtype.element_ty), mask=mt)
        tl.store(DBETA + row, dbeta.to(DBETA.dtype.element_ty), mask=mt)
    tl.store(DH0 + pid.to(tl.int64) * DK * DV + state_offs, dS, mask=state_mask)


def _launch_args(k: Tensor, v: Tensor, chunk_size: int) -> dict[str, Any]:
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size}: the kernel takes a power of two >= 16")
    dk, dv = k.shape[-1], v.shape[-1]
    return dict(DK=dk, DV=dv, BK=max(16, next_power_of_2(dk)), BV=max(16, next_power_of_2(dv)), BT=chunk_size,
                LOG2_BT=chunk_size.bit_length() - 1, PREC="ieee" if v.dtype == torch.float32 else "tf32",
                num_warps=4)


def chunk_gated_delta_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor,
                          initial_state: Tensor, scale: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(o [B, T, H, V], final state [B, H, K, V] fp32, the state entering each chunk [B, H, N, K, V] fp32) for
    q, k [B, T, H, K] (key heads already expanded to the value heads), g, beta [B, T, H], doc_ids [B, T] and
    initial_state [B, H, K, V], all contiguous."""
    launch = _launch_args(k, v, chunk_size)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    o = torch.empty_like(v)
    final = torch.empty(b, h, dk, dv, dtype=torch.float32, device=v.device)
    states = torch.empty(b, h, -(-t // chunk_size), dk, dv, dtype=torch.float32, device=v.device)
    _gated_delta_fwd_kernel[(b * h,)](q, k, v, g, beta, doc_ids, initial_state, o, final, states, t, h, scale,
                                      **launch)
    return o, final, states


class ChunkGatedDelta(torch.autograd.Function):
    """forward(q, k, v, g, beta, initial_state, doc_ids, scale, chunk_size) -> (o, final state): the forward
    kernel saves the state entering each chunk; the backward kernel walks the chunks in reverse from them."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # type: ignore[override]
                initial_state: Tensor, doc_ids: Tensor, scale: float, chunk_size: int) -> tuple[Tensor, Tensor]:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        doc_ids, initial_state = doc_ids.long().contiguous(), initial_state.float().contiguous()
        o, final, states = chunk_gated_delta_fwd(q, k, v, g, beta, doc_ids, initial_state, scale, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, doc_ids, states)
        ctx.scale, ctx.chunk_size, ctx.state_dtype = scale, chunk_size, initial_state.dtype
        return o, final

    @staticmethod
    def backward(ctx: Any, d_o: Optional[Tensor], d_final: Optional[Tensor]  # type: ignore[override]
                 ) -> tuple[Optional[Tensor], ...]:
        q, k, v, g, beta, doc_ids, states = ctx.saved_tensors
        b, t, h, dk = k.shape
        d_o = torch.zeros_like(v) if d_o is None else d_o.contiguous()
        d_final = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device) if d_final is None
                   else d_final.float().contiguous())
        dq, dk_, dv, dg, dbeta = (torch.empty_like(x) for x in (q, k, v, g, beta))
        d_initial = torch.empty_like(d_final)
        _gated_delta_bwd_kernel[(b * h,)](q, k, v, g, beta, doc_ids, states, d_o, d_final, dq, dk_, dv, dg, dbeta,
                                          d_initial, t, h, ctx.scale, **_launch_args(k, v, ctx.chunk_size))
        return dq, dk_, dv, dg, dbeta, d_initial, None, None, None
