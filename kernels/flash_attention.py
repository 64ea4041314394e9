"""Causal flash attention with grouped-query heads, forward and backward (FlashAttention-2).

Dao 2023, "FlashAttention-2": the S x S score matrix is never stored. Forward walks the keys in
blocks with an online softmax and saves only the output O and one logsumexp per query row.
Backward recomputes the probabilities block by block from Q, K and the logsumexp:
  preprocess  delta_i = sum_d dO_id * O_id                    (one value per query row)
  dK, dV      one program per (key block, kv head): loops over the query heads of its group and
              the query blocks, so grouped-query heads are summed without atomics
  dQ          one program per (query block, query head): loops over the key blocks
with P = exp(S - lse), dP = dO V^T, dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q,
dV = P^T dO. Memory is O(sequence): O, lse and delta besides the inputs and gradients.
Scores are kept in base 2 (scale * log2(e) folded into QK^T) so that exp2 is used throughout;
the saved lse is therefore in log2 units (internal to this file).
Layout is [batch, seq, heads, head_dim]; query head h uses kv head h // (Hq // Hk) (Ainslie et al.
2023, "GQA"). The kernels take separate query and key lengths and an optional mask in global token
positions for `flash_attention_block.py` (one key block of ring / all-gather context-parallel attention).

What plain FlashAttention-2 does not have (document segment ids, the sliding window, the soft-cap, the sinks)
is described, and its helpers kept, in `flash_attention_variant.py`; the kernels here apply them under
constexpr flags (SEGMENTS, HAS_WINDOW, SOFTCAP, HAS_SINKS), so a plain call compiles none of it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ._triton import cdiv, interpreting, jit, next_power_of_2, tl, upcast_dots  # lazy stand-ins: _triton.py
from .flash_attention_variant import (LOG2E, PLAIN, Segments, Variant, _logits, _same, _segment_args, _segment_range,
                                      _window_keep, check_variant, sink_grad)


@jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, QPOS, KPOS, QSEG, KSEG, SINKS, TILES, scale_log2, cap_in, cap_out, WINDOW, SQ, SK, Hq, GROUP, D,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    CAUSAL: tl.constexpr, POSITIONS: tl.constexpr, SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)  # int64 offsets: batch * stride may pass 2^31 elements
    h = bh % Hq
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                mask=(offs_m[:, None] < SQ) & d_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if POSITIONS:  # key j is visible to query i iff 0 <= QPOS[i] - KPOS[j] (< WINDOW): causal in global positions
        q_pos, qp_lo, qp_hi = _segment_range(QPOS, offs_m, SQ)
    if SEGMENTS:  # this query tile's documents: [q_lo, q_hi]
        q_seg, q_lo, q_hi = _segment_range(QSEG + b * SQ, offs_m, SQ)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = SK
    if CAUSAL:  # SQ == SK: keys after the block's last query are masked, and those a window leaves behind
        hi = tl.minimum((start_m + 1) * BLOCK_M, SK)
        if HAS_WINDOW:
            lo = tl.maximum(start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        run = True
        if SEGMENTS:  # skip a tile of keys none of whose documents is one of the queries'
            k_seg, k_lo, k_hi = _segment_range(KSEG + b * SK, offs_n, SK)
            run = (k_hi >= q_lo) & (k_lo <= q_hi)
        if POSITIONS:  # skip a tile of keys all after the queries, or all a window or more before them
            k_pos, kp_lo, kp_hi = _segment_range(KPOS, offs_n, SK)
            run = (kp_lo <= qp_hi) & run
            if HAS_WINDOW:
                run = (qp_lo - kp_hi < WINDOW) & run
        if run:
            if COUNT:
                tl.atomic_add(TILES, 1)
            kv_mask = (offs_n[:, None] < SK) & d_mask
            k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk, _ = _logits(tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2, cap_in, cap_out, SOFTCAP)
            valid = offs_n[None, :] < SK
            if CAUSAL:
                valid = _window_keep(valid & (offs_m[:, None] >= offs_n[None, :]), offs_m, offs_n, WINDOW, HAS_WINDOW)
            if POSITIONS:
                valid = _window_keep(valid & (q_pos[:, None] >= k_pos[None, :]), q_pos, k_pos, WINDOW, HAS_WINDOW)
            if SEGMENTS:
                valid = valid & (q_seg[:, None] == k_seg[None, :])
            qk = tl.where(valid, qk, -float("inf"))
            # Online softmax (Milakov & Gimelshein 2018): rescale what was accumulated so far. A row with no
            # visible key in this tile yet (document masks) keeps m = -inf: its alpha and p are taken as 0.
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p_v = p.to(V.dtype.element_ty)
            if UPCAST:
                p_v = p_v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PREC)
            m_i = m_new
    if HAS_SINKS:  # the sink's logit (base 2) joins each row's denominator with no value: O and L rescaled
        sink = tl.load(SINKS + h)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past SQ under document masks see no key: keep them finite
    acc = acc / l_i[:, None]
    m_mask = offs_m < SQ
    tl.store(LSE + bh * SQ + offs_m, m_i + tl.log2(l_i), mask=m_mask)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask)


@jit
def _attn_bwd_preprocess_kernel(O, DO, DELTA, S, Hq, D, sob, sos, soh, sdob, sdos, sdoh,
                                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)  # int64 offsets: batch * stride may pass 2^31 elements
    h = bh % Hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < S) & (offs_d[None, :] < D)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * S + offs_m, delta, mask=offs_m < S)


@jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, QSEG, KSEG, TILES, scale, scale_log2, cap_in, cap_out, WINDOW,
    SQ, SK, Hq, Hk, GROUP, D,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh,
    CAUSAL: tl.constexpr, POSITIONS: tl.constexpr, SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // Hk).to(tl.int64)
    hk = bhk % Hk
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < SK) & d_mask
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if POSITIONS:
        k_pos, kp_lo, kp_hi = _segment_range(KPOS, offs_n, SK)
    if SEGMENTS:
        k_seg, k_lo, k_hi = _segment_range(KSEG + b * SK, offs_n, SK)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = SQ
    if CAUSAL:  # SQ == SK: earlier queries cannot see these keys, nor queries a window or more after them
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(start_n * BLOCK_N + BLOCK_N - 1 + WINDOW, SQ)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        row_base = (b * Hq + h) * SQ
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            run = True
            if SEGMENTS:  # skip a tile of queries none of whose documents is one of these keys'
                q_seg, q_lo, q_hi = _segment_range(QSEG + b * SQ, offs_m, SQ)
                run = (k_hi >= q_lo) & (k_lo <= q_hi)
            if POSITIONS:
                q_pos, qp_lo, qp_hi = _segment_range(QPOS, offs_m, SQ)
                run = (kp_lo <= qp_hi) & run
                if HAS_WINDOW:
                    run = (qp_lo - kp_hi < WINDOW) & run
            if run:
                if COUNT:
                    tl.atomic_add(TILES + 1, 1)
                m_mask = offs_m < SQ
                q_mask = m_mask[:, None] & d_mask
                q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)
                do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=q_mask,
                             other=0.0)
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse = tl.load(LSE + row_base + offs_m, mask=m_mask, other=0.0)
                delta = tl.load(DELTA + row_base + offs_m, mask=m_mask, other=0.0)
                # Transposed scores [BLOCK_N, BLOCK_M]: rows are this program's keys.
                s_t, t_t = _logits(tl.dot(k, tl.trans(q), input_precision=PREC) * scale_log2, cap_in, cap_out, SOFTCAP)
                p_t = tl.exp2(s_t - lse[None, :])
                valid = m_mask[None, :]
                if CAUSAL:  # transposed: rows are keys
                    valid = valid & (offs_m[None, :] >= offs_n[:, None])
                    if HAS_WINDOW:
                        valid = valid & (offs_m[None, :] - offs_n[:, None] < WINDOW)
                if POSITIONS:
                    valid = valid & (q_pos[None, :] >= k_pos[:, None])
                    if HAS_WINDOW:
                        valid = valid & (q_pos[None, :] - k_pos[:, None] < WINDOW)
                if SEGMENTS:
                    valid = valid & (q_seg[None, :] == k_seg[:, None])
                p_t = tl.where(valid, p_t, 0.0)
                p_lo = p_t.to(DO.dtype.element_ty)
                if UPCAST:
                    p_lo = p_lo.to(tl.float32)
                dv += tl.dot(p_lo, do, input_precision=PREC)
                dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
                ds_t = p_t * (dp_t - delta[None, :])
                if SOFTCAP:  # through c tanh(s / c): 1 - tanh^2
                    ds_t = ds_t * (1.0 - t_t * t_t)
                ds_t = ds_t.to(Q.dtype.element_ty)
                if UPCAST:
                    ds_t = ds_t.to(tl.float32)
                dk += tl.dot(ds_t, q, input_precision=PREC)
    out_off = b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, QSEG, KSEG, TILES, scale, scale_log2, cap_in, cap_out, WINDOW,
    SQ, SK, Hq, GROUP, D,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    CAUSAL: tl.constexpr, POSITIONS: tl.constexpr, SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)  # int64 offsets: batch * stride may pass 2^31 elements
    h = bh % Hq
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < D
    m_mask = offs_m < SQ
    q_mask = m_mask[:, None] & d_mask
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh * SQ + offs_m, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + bh * SQ + offs_m, mask=m_mask, other=0.0)
    if POSITIONS:
        q_pos, qp_lo, qp_hi = _segment_range(QPOS, offs_m, SQ)
    if SEGMENTS:
        q_seg, q_lo, q_hi = _segment_range(QSEG + b * SQ, offs_m, SQ)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = SK
    if CAUSAL:  # SQ == SK: as the forward
        hi = tl.minimum((start_m + 1) * BLOCK_M, SK)
        if HAS_WINDOW:
            lo = tl.maximum(start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        run = True
        if SEGMENTS:
            k_seg, k_lo, k_hi = _segment_range(KSEG + b * SK, offs_n, SK)
            run = (k_hi >= q_lo) & (k_lo <= q_hi)
        if POSITIONS:
            k_pos, kp_lo, kp_hi = _segment_range(KPOS, offs_n, SK)
            run = (kp_lo <= qp_hi) & run
            if HAS_WINDOW:
                run = (qp_lo - kp_hi < WINDOW) & run
        if run:
            if COUNT:
                tl.atomic_add(TILES + 2, 1)
            kv_mask = (offs_n[:, None] < SK) & d_mask
            k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s_qk, t_qk = _logits(tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2, cap_in, cap_out, SOFTCAP)
            p = tl.exp2(s_qk - lse[:, None])
            valid = offs_n[None, :] < SK
            if CAUSAL:
                valid = _window_keep(valid & (offs_m[:, None] >= offs_n[None, :]), offs_m, offs_n, WINDOW, HAS_WINDOW)
            if POSITIONS:
                valid = _window_keep(valid & (q_pos[:, None] >= k_pos[None, :]), q_pos, k_pos, WINDOW, HAS_WINDOW)
            if SEGMENTS:
                valid = valid & (q_seg[:, None] == k_seg[None, :])
            p = tl.where(valid, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:  # through c tanh(s / c): 1 - tanh^2
                ds = ds * (1.0 - t_qk * t_qk)
            ds = ds.to(Q.dtype.element_ty)
            if UPCAST:
                ds = ds.to(tl.float32)
            dq += tl.dot(ds, k, input_precision=PREC)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _config(D: int, dtype: torch.dtype) -> dict[str, Any]:
    """Block sizes and precision. Under the interpreter: 16-wide blocks, so tiny test sequences
    still span several blocks and exercise the masked tails."""
    block_d = max(16, next_power_of_2(D))
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interpreting():
        return dict(fwd=(16, 16, 1, 1), bwd=(16, 16, 1, 1), BLOCK_D=block_d, PREC=prec, UPCAST=True)
    # (BLOCK_M, BLOCK_N, warps, stages). Starting points after the Triton FA-2 tutorial's Hopper
    # settings, not tuned on hardware here: bf16/fp16 with head_dim <= 128 take the large tiles,
    # fp32 and head_dim > 128 halve them to stay within registers and shared memory.
    small_d = block_d <= 64
    if dtype == torch.float32 or block_d > 128:
        fwd, bwd = (64, 32, 4 if small_d else 8, 2), (32, 32, 4 if small_d else 8, 2)
    else:
        fwd, bwd = (128, 64, 4 if small_d else 8, 3), (32, 128 if small_d else 64, 4 if small_d else 8, 3)
    return dict(fwd=fwd, bwd=bwd, BLOCK_D=block_d, PREC=prec, UPCAST=upcast_dots(dtype))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# (query positions [SQ], key positions [SK]): key j is visible to query i iff key[j] <= query[i].
Positions = Optional[tuple[torch.Tensor, torch.Tensor]]


def _position_args(positions: Positions, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The QPOS, KPOS kernel arguments: the contiguous positions, or a placeholder the kernel never reads."""
    if positions is None:
        return placeholder, placeholder
    return positions[0].contiguous(), positions[1].contiguous()


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse2: torch.Tensor,
             causal: bool, scale: float, positions: Positions = None, segments: Segments = None,
             variant: Variant = PLAIN) -> None:
    """Write O (any dtype and strides, unit last) and the base-2 logsumexp (fp32 [B*Hq, SQ], contiguous)
    of q [B, SQ, Hq, D] against k/v [B, SK, Hk, D]."""
    B, SQ, Hq, D = q.shape
    SK, Hk = k.shape[1], k.shape[2]
    cfg = _config(D, q.dtype)
    block_m, block_n, warps, stages = cfg["fwd"]
    sinks2 = lse2 if variant.sinks is None else (variant.sinks.detach().float() * LOG2E).contiguous()
    tiles, cap_in, cap_out, window = variant.args(lse2)
    _attn_fwd_kernel[(cdiv(SQ, block_m), B * Hq)](
        q, k, v, o, lse2, *_position_args(positions, lse2), *_segment_args(segments, lse2), sinks2, tiles,
        scale * LOG2E, cap_in, cap_out, window, SQ, SK, Hq, Hq // Hk, D,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        CAUSAL=causal, POSITIONS=positions is not None, SEGMENTS=segments is not None, UPCAST=cfg["UPCAST"],
        PREC=cfg["PREC"], HAS_SINKS=variant.sinks is not None, **variant.flags(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=cfg["BLOCK_D"], num_warps=warps, num_stages=stages,
    )


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse2: torch.Tensor,
              delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool,
              scale: float, positions: Positions = None, segments: Segments = None,
              variant: Variant = PLAIN) -> None:
    """Write dQ, dK, dV given the base-2 logsumexp and delta = rowsum(dO * O) (fp32 [B*Hq, SQ] each); with sinks,
    the forward's LSE and O had them folded in, which is all the backward needs of them (d sinks: `sink_grad`)."""
    B, SQ, Hq, D = q.shape
    SK, Hk = k.shape[1], k.shape[2]
    cfg = _config(D, q.dtype)
    block_m, block_n, warps, stages = cfg["bwd"]
    common = dict(CAUSAL=causal, POSITIONS=positions is not None, SEGMENTS=segments is not None,
                  UPCAST=cfg["UPCAST"], PREC=cfg["PREC"], BLOCK_D=cfg["BLOCK_D"], num_warps=warps, num_stages=stages,
                  **variant.flags())
    pos = (*_position_args(positions, lse2), *_segment_args(segments, lse2))
    tiles, cap_in, cap_out, window = variant.args(lse2)
    _attn_bwd_dkdv_kernel[(cdiv(SK, block_n), B * Hk)](
        q, k, v, do, lse2, delta, dk, dv, *pos, tiles, scale, scale * LOG2E, cap_in, cap_out, window,
        SQ, SK, Hq, Hk, Hq // Hk, D,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
        BLOCK_M=block_m, BLOCK_N=block_n, **common,
    )
    # dQ: many query rows per program, few keys at a time (the mirror image of dK/dV).
    _attn_bwd_dq_kernel[(cdiv(SQ, block_n), B * Hq)](
        q, k, v, do, lse2, delta, dq, *pos, tiles, scale, scale * LOG2E, cap_in, cap_out, window,
        SQ, SK, Hq, Hq // Hk, D,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        BLOCK_M=block_n, BLOCK_N=block_m, **common,
    )


def _delta(o: torch.Tensor, do: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O), fp32 [B*Hq, S] (the backward's preprocess kernel)."""
    B, S, Hq, D = o.shape
    delta = torch.empty_like(lse2)
    _attn_bwd_preprocess_kernel[(cdiv(S, 64), B * Hq)](
        o, do, delta, S, Hq, D, *_strides(o), *_strides(do), BLOCK_M=64, BLOCK_D=_config(D, o.dtype)["BLOCK_D"])
    return delta


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sinks: Optional[torch.Tensor], causal: bool, scale: float, segments: Optional[torch.Tensor],
                variant: Variant) -> torch.Tensor:
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        B, S, Hq, D = q.shape
        o = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
        lse2 = torch.empty((B * Hq, S), dtype=torch.float32, device=q.device)
        variant = Variant(variant.window, variant.softcap, sinks, variant.tiles)
        _forward(q, k, v, o, lse2, causal, scale, segments=_same(segments), variant=variant)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.causal, ctx.scale, ctx.segments, ctx.variant = causal, scale, segments, variant
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, o, lse2 = ctx.saved_tensors
        do = _unit_last(do)
        B, S, Hq, D = q.shape
        delta = _delta(o, do, lse2)
        dq = torch.empty_like(q)
        dk = torch.empty((B, S, k.shape[2], D), dtype=k.dtype, device=k.device)
        dv = torch.empty((B, S, v.shape[2], D), dtype=v.dtype, device=v.device)
        _backward(q, k, v, do, lse2, delta, dq, dk, dv, ctx.causal, ctx.scale, segments=_same(ctx.segments),
                  variant=ctx.variant)
        sinks = ctx.variant.sinks
        d_sinks = None if sinks is None else sink_grad(lse2, delta, sinks)
        return dq, dk, dv, d_sinks, None, None, None, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "flash_attention",
           same_length: bool = True) -> None:
    if (q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]
            or (same_length and q.shape[1] != k.shape[1]) or k.shape[1] == 0):
        seq_k = "S" if same_length else "SK"
        raise ValueError(f"{name}: need q [B,S,Hq,D], k = v [B,{seq_k},Hk,D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{name}: query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: float | None = None, segments: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                    tiles: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * Q K^T [+ causal mask]) V per head, [B,S,Hq,D] out; grouped-query kv heads.
    `segments` [B, S] integer document ids (document masking): query i sees key j only when both are in
    the same document; tiles with no such pair are skipped (module doc). Every query row must keep a key:
    true with causal (it sees itself). The variant (megalite/attention/variant.py): `window` (causal only: key
    j seen iff i - W < j <= i; tiles wholly outside are never visited), `softcap` (scores c tanh(s / c)),
    `sinks` [Hq] (a logit per head in each row's denominator; differentiable), `tiles` (`Variant`)."""
    _check(q, k, v)
    if segments is not None and (segments.shape != q.shape[:2] or segments.is_floating_point()):
        raise ValueError(f"flash_attention: segments must be integer [B, S] = {tuple(q.shape[:2])}, got "
                         f"{segments.dtype} {tuple(segments.shape)}")
    variant = Variant(window, softcap, None, tiles)
    check_variant(Variant(window, softcap, sinks, tiles), causal, q.shape[2], "flash_attention")
    return _FlashAttention.apply(q, k, v, sinks, causal, _scale(q, softmax_scale), segments, variant)
