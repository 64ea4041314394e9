"""The gated delta rule's chunk kernel (Gated DeltaNet, Kimi Delta Attention, Mamba2's SSD): the chunked form of
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

Every exponent is <= 0 (g <= 0 and masked pairs never exponentiated), so nothing overflows. The three gates of
megalite/recurrent/recurrence.py are two compile-time switches:

    PER_CHANNEL (Kimi Delta Attention): g [B, T, H, K], so cum [BT, BK] is each key channel's decay from the
        chunk's start and D_ij becomes D_ijk = exp(cum_ik - cum_jk) [BT, BT, BK]; the pair terms contract it
        (sum_k a_ik b_jk D_ijk) instead of scaling a matmul. Stability: every exponent is a difference of
        cumulative log decays against a reference inside the chunk that is no later (the pair's earlier token,
        the chunk's start, or, for the tail, the token itself against the chunk's end), so each factor is in
        [0, 1]. Factorising D_ijk = exp(cum_ik) exp(-cum_jk), as the scalar path's matmuls could, would need
        exp(-cum) = exp of a large positive number once a channel decays fast (overflow past e^88 in fp32): the
        kernel never does. The [BT, BT, BK] tile is register-hungry on a GPU; FLA's chunk_kda sub-chunks (16
        tokens, references at each sub-chunk's start) for that.
    ERASE False (Mamba2's SSD): no delta rule, so A = 0, (I + A)^-1 = I and V' = beta v.

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
def _pair(a, b, decay, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """[BT, BT]: sum_k a_ik b_jk D_ij(k), the chunk's pair terms (D [BT, BT] or, per channel, [BT, BT, BK])."""
    if PER_CHANNEL:
        return tl.sum(a[:, None, :] * b[None, :, :] * decay, 2)
    return tl.dot(a, tl.trans(b), input_precision=PREC) * decay


@jit
def _per_key(e, PER_CHANNEL: tl.constexpr):
    """A per-token factor [BT] (or [BT, BK] per channel), made to scale rows of a [BT, BK] tile."""
    if PER_CHANNEL:
        return e
    return e[:, None]


@jit
def _on_state(carried, PER_CHANNEL: tl.constexpr):
    """The chunk's decay of S: a scalar, or per key channel [BK] made to scale S's rows."""
    if PER_CHANNEL:
        return carried[:, None]
    return carried


@jit
def _chunk_terms(Q, K, V, G, BETA, DOC, b, h, c, T, H, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
                 PER_CHANNEL: tl.constexpr, ERASE: tl.constexpr):
    """Load chunk c of sequence b, head h, and compute what the forward and the backward both need."""
    rk, rv, rt = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    t0 = c * BT
    offs = t0 + rt
    mt = offs < T
    row = ((b * T + offs) * H + h).to(tl.int64)
    kmask = mt[:, None] & (rk < DK)[None, :]
    q = tl.load(Q + row[:, None] * DK + rk[None, :], mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(K + row[:, None] * DK + rk[None, :], mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + row[:, None] * DV + rv[None, :], mask=mt[:, None] & (rv < DV)[None, :], other=0.0).to(tl.float32)
    beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
    doc = tl.load(DOC + b * T + tl.minimum(offs, T - 1))          # padded tokens: the last one's document
    state_doc = tl.load(DOC + b * T + tl.maximum(t0 - 1, 0))     # the document of the state entering
    seen = (doc[:, None] == doc[None, :]) & (rt[:, None] >= rt[None, :])
    strict = seen & (rt[:, None] > rt[None, :])
    doc_last = tl.max(doc, 0)                                    # documents never decrease
    first, tail = doc == state_doc, doc == doc_last
    if PER_CHANNEL:
        # cum [BT, BK]: each key channel's decay from the chunk's start. Only differences are exponentiated,
        # each against a reference inside the chunk that is no later: cum_i - cum_j with j <= i (the pair's
        # earlier token), cum_i - 0 (the chunk's start), cum_last - cum_i (the chunk's end). g <= 0 makes every
        # exponent <= 0, so no factor exceeds 1 however fast a channel decays (a factorised exp(cum_i) *
        # exp(-cum_j) would overflow in fp32 once a channel's decay over the chunk passes e^88).
        g = tl.load(G + row[:, None] * DK + rk[None, :], mask=kmask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)
        diff = cum[:, None, :] - cum[None, :, :]                 # [BT, BT, BK]
        decay = tl.where(seen[:, :, None], tl.exp(tl.where(seen[:, :, None], diff, 0.0)), 0.0)
        e_first = tl.where(first[:, None], tl.exp(cum), 0.0)
        cum_last = tl.sum(tl.where((rt == BT - 1)[:, None], cum, 0.0), 0)   # [BK]; padded g = 0
        e_tail = tl.where(tail[:, None], tl.exp(cum_last[None, :] - cum), 0.0)
    else:
        g = tl.load(G + row, mask=mt, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)
        decay = tl.where(seen, tl.exp(tl.where(seen, cum[:, None] - cum[None, :], 0.0)), 0.0)
        e_first = tl.where(first, tl.exp(cum), 0.0)
        cum_last = tl.sum(tl.where(rt == BT - 1, cum, 0.0), 0)      # padded g = 0: the last real token's
        e_tail = tl.where(tail, tl.exp(cum_last - cum), 0.0)
    carried = tl.where(doc_last == state_doc, tl.exp(cum_last), 0.0)
    inv = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)
    if ERASE:
        neg_a = tl.where(strict, -_pair(k * beta[:, None], k, decay, PER_CHANNEL, PREC), 0.0)
        inv = inv + neg_a
        power = neg_a
        for _ in tl.static_range(LOG2_BT - 1):
            power = tl.dot(power, power, input_precision=PREC)
            inv = inv + tl.dot(inv, power, input_precision=PREC)
    return row, mt, q, k, v, beta, seen, strict, decay, inv, e_first, e_tail, carried


@jit
def _gated_delta_fwd_kernel(Q, K, V, G, BETA, DOC, H0, O, HT, STATES, T, H, scale,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
                            PER_CHANNEL: tl.constexpr, ERASE: tl.constexpr):
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    state_offs = rk[:, None] * DV + rv[None, :]
    state_mask = (rk < DK)[:, None] & (rv < DV)[None, :]
    S = tl.load(H0 + pid.to(tl.int64) * DK * DV + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    chunks = tl.cdiv(T, BT)
    for c in range(0, chunks):
        row, mt, q, k, v, beta, seen, strict, decay, inv, e_first, e_tail, carried = _chunk_terms(
            Q, K, V, G, BETA, DOC, b, h, c, T, H, DK, DV, BK, BV, BT, LOG2_BT, PREC, PER_CHANNEL, ERASE)
        tl.store(STATES + (pid.to(tl.int64) * chunks + c) * DK * DV + state_offs, S, mask=state_mask)
        written = tl.dot(inv, v * beta[:, None], input_precision=PREC)
        if ERASE:
            w = tl.dot(inv, k * beta[:, None] * _per_key(e_first, PER_CHANNEL), input_precision=PREC)
            written = written - tl.dot(w, S, input_precision=PREC)
        qk = tl.where(seen, _pair(q, k, decay, PER_CHANNEL, PREC), 0.0)
        o = scale * (tl.dot(q * _per_key(e_first, PER_CHANNEL), S, input_precision=PREC)
                     + tl.dot(qk, written, input_precision=PREC))
        tl.store(O + row[:, None] * DV + rv[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & (rv < DV)[None, :])
        S = S * _on_state(carried, PER_CHANNEL) + tl.dot(tl.trans(k * _per_key(e_tail, PER_CHANNEL)), written,
                                                         input_precision=PREC)
    tl.store(HT + pid.to(tl.int64) * DK * DV + state_offs, S, mask=state_mask)


@jit
def _gated_delta_bwd_kernel(Q, K, V, G, BETA, DOC, STATES, DO, DHT, DQ, DK_, DV_, DG, DBETA, DH0, T, H, scale,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
                            PER_CHANNEL: tl.constexpr, ERASE: tl.constexpr):
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
            Q, K, V, G, BETA, DOC, b, h, c, T, H, DK, DV, BK, BV, BT, LOG2_BT, PREC, PER_CHANNEL, ERASE)
        S = tl.load(STATES + (pid.to(tl.int64) * chunks + c) * DK * DV + state_offs, mask=state_mask, other=0.0)
        kmask = mt[:, None] & (rk < DK)[None, :]
        vmask = mt[:, None] & (rv < DV)[None, :]
        do = scale * tl.load(DO + row[:, None] * DV + rv[None, :], mask=vmask, other=0.0).to(tl.float32)
        ef, et, cs = _per_key(e_first, PER_CHANNEL), _per_key(e_tail, PER_CHANNEL), _on_state(carried, PER_CHANNEL)
        # The forward again: the values written and the chunk's pair terms.
        kb, vb = k * beta[:, None], v * beta[:, None]
        kbe, qe, ket = kb * ef, q * ef, k * et
        w = tl.dot(inv, kbe, input_precision=PREC)
        written = tl.dot(inv, vb, input_precision=PREC)
        if ERASE:
            written = written - tl.dot(w, S, input_precision=PREC)
        pair = tl.where(seen, _pair(q, k, decay, PER_CHANNEL, PREC), 0.0)
        # S' = carried S + ket^T V'  and  O = qe S + pair V' (scale folded into do).
        d_carried_rows = tl.sum(S * dS, 1)                           # [BK]: per row of S
        d_ket = tl.dot(written, tl.trans(dS), input_precision=PREC)
        d_written = tl.dot(ket, dS, input_precision=PREC) + tl.dot(tl.trans(pair), do, input_precision=PREC)
        d_pair = tl.where(seen, tl.dot(do, tl.trans(written), input_precision=PREC), 0.0)
        d_qe = tl.dot(do, tl.trans(S), input_precision=PREC)
        dS_prev = cs * dS + tl.dot(tl.trans(qe), do, input_precision=PREC)
        d_vb = d_written
        d_kbe = d_qe * 0.0
        d_a = d_pair * 0.0
        if ERASE:
            # V' = inv vb - inv kbe S, inv = (I + A)^-1: d inv = dV' vb^T - dV' S^T kbe^T, dA = -inv^T d_inv inv^T.
            d_w = -tl.dot(d_written, tl.trans(S), input_precision=PREC)
            d_inv = (tl.dot(d_written, tl.trans(vb), input_precision=PREC)
                     + tl.dot(d_w, tl.trans(kbe), input_precision=PREC))
            d_vb = tl.dot(tl.trans(inv), d_written, input_precision=PREC)
            d_kbe = tl.dot(tl.trans(inv), d_w, input_precision=PREC)
            inv_t = tl.trans(inv)
            d_a = tl.where(strict, -tl.dot(tl.dot(inv_t, d_inv, input_precision=PREC), inv_t, input_precision=PREC),
                           0.0)
            dS_prev = dS_prev - tl.dot(tl.trans(w), d_written, input_precision=PREC)
        dS = dS_prev
        # A = (kb k^T) D [strict], pair = (q k^T) D [seen]; D = exp(cum_i - cum_j) (per key channel, or not).
        if PER_CHANNEL:
            d_ad, d_pd = d_a[:, :, None] * decay, d_pair[:, :, None] * decay             # [BT, BT, BK]
            d_kb = tl.sum(d_ad * k[None, :, :], 1) + d_kbe * ef
            dk = (tl.sum(d_ad * kb[:, None, :], 0) + tl.sum(d_pd * q[:, None, :], 0) + d_ket * et
                  + d_kb * beta[:, None])
            dq = tl.sum(d_pd * k[None, :, :], 1) + d_qe * ef
            e = (d_ad * kb[:, None, :] + d_pd * q[:, None, :]) * k[None, :, :]
            d_cum = tl.sum(e, 1) - tl.sum(e, 0)                                          # [BT, BK]
            d_cum += (d_qe * q + d_kbe * kb) * ef
            d_et = d_ket * k * et
            d_cum -= d_et
            d_cum += tl.where((rt == BT - 1)[:, None], (tl.sum(d_et, 0) + d_carried_rows * carried)[None, :], 0.0)
        else:
            d_ad, d_pd = d_a * decay, d_pair * decay
            d_kb = tl.dot(d_ad, k, input_precision=PREC) + d_kbe * ef
            dk = (tl.dot(tl.trans(d_ad), kb, input_precision=PREC) + tl.dot(tl.trans(d_pd), q, input_precision=PREC)
                  + d_ket * et + d_kb * beta[:, None])
            dq = tl.dot(d_pd, k, input_precision=PREC) + d_qe * ef
            e = (d_ad * tl.dot(kb, tl.trans(k), input_precision=PREC)
                 + d_pd * tl.dot(q, tl.trans(k), input_precision=PREC))
            d_cum = tl.sum(e, 1) - tl.sum(e, 0)
            d_cum += (tl.sum(d_qe * q, 1) + tl.sum(d_kbe * kb, 1)) * e_first
            d_et = tl.sum(d_ket * k, 1) * e_tail
            d_cum -= d_et
            d_cum += tl.where(rt == BT - 1, tl.sum(d_et, 0) + tl.sum(d_carried_rows, 0) * carried, 0.0)
        dg = tl.sum(d_cum, 0) - tl.cumsum(d_cum, 0) + d_cum           # g_i enters every cum_j with j >= i
        dbeta = tl.sum(d_kb * k, 1) + tl.sum(d_vb * v, 1)
        tl.store(DQ + row[:, None] * DK + rk[None, :], dq.to(DQ.dtype.element_ty), mask=kmask)
        tl.store(DK_ + row[:, None] * DK + rk[None, :], dk.to(DK_.dtype.element_ty), mask=kmask)
        tl.store(DV_ + row[:, None] * DV + rv[None, :], (d_vb * beta[:, None]).to(DV_.dtype.element_ty), mask=vmask)
        if PER_CHANNEL:
            tl.store(DG + row[:, None] * DK + rk[None, :], dg.to(DG.dtype.element_ty), mask=kmask)
        else:
            tl.store(DG + row, dg.to(DG.dtype.element_ty), mask=mt)
        tl.store(DBETA + row, dbeta.to(DBETA.dtype.element_ty), mask=mt)
    tl.store(DH0 + pid.to(tl.int64) * DK * DV + state_offs, dS, mask=state_mask)


def _launch_args(k: Tensor, v: Tensor, g: Tensor, chunk_size: int, erase: bool) -> dict[str, Any]:
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size}: the kernel takes a power of two >= 16")
    dk, dv = k.shape[-1], v.shape[-1]
    return dict(DK=dk, DV=dv, BK=max(16, next_power_of_2(dk)), BV=max(16, next_power_of_2(dv)), BT=chunk_size,
                LOG2_BT=chunk_size.bit_length() - 1, PREC="ieee" if v.dtype == torch.float32 else "tf32",
                PER_CHANNEL=g.dim() == 4, ERASE=erase, num_warps=4)


def chunk_gated_delta_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor,
                          initial_state: Tensor, scale: float, chunk_size: int, erase: bool = True
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """(o [B, T, H, V], final state [B, H, K, V] fp32, the state entering each chunk [B, H, N, K, V] fp32) for
    q, k [B, T, H, K] (key heads already expanded to the value heads), g [B, T, H] or [B, T, H, K] (per key
    channel), beta [B, T, H], doc_ids [B, T] and initial_state [B, H, K, V], all contiguous; `erase` False runs
    Mamba2's write (no delta rule)."""
    launch = _launch_args(k, v, g, chunk_size, erase)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    o = torch.empty_like(v)
    final = torch.empty(b, h, dk, dv, dtype=torch.float32, device=v.device)
    states = torch.empty(b, h, -(-t // chunk_size), dk, dv, dtype=torch.float32, device=v.device)
    _gated_delta_fwd_kernel[(b * h,)](q, k, v, g, beta, doc_ids, initial_state, o, final, states, t, h, scale,
                                      **launch)
    return o, final, states


class ChunkGatedDelta(torch.autograd.Function):
    """forward(q, k, v, g, beta, initial_state, doc_ids, scale, chunk_size, erase) -> (o, final state): the forward
    kernel saves the state entering each chunk; the backward kernel walks the chunks in reverse from them."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # type: ignore[override]
                initial_state: Tensor, doc_ids: Tensor, scale: float, chunk_size: int, erase: bool = True
                ) -> tuple[Tensor, Tensor]:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        doc_ids, initial_state = doc_ids.long().contiguous(), initial_state.float().contiguous()
        o, final, states = chunk_gated_delta_fwd(q, k, v, g, beta, doc_ids, initial_state, scale, chunk_size, erase)
        ctx.save_for_backward(q, k, v, g, beta, doc_ids, states)
        ctx.scale, ctx.chunk_size, ctx.erase, ctx.state_dtype = scale, chunk_size, erase, initial_state.dtype
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
                                          d_initial, t, h, ctx.scale, **_launch_args(k, v, g, ctx.chunk_size, ctx.erase))
        return dq, dk_, dv, dg, dbeta, d_initial, None, None, None, None
