"""MLA's costs from its shapes alone (no torch): parameters, FLOPs, activation bytes, and the KV cache a decoder
keeps. megalite/model/params.py and megalite/perfmodel import these; docs/mla.md derives them.

Notation: h hidden, H heads, r_q = q_lora_rank (0: a plain q projection), r_kv = kv_lora_rank, d_n nope, d_r rope,
d_v v_head_dim, d = d_n + d_r (the q/k head width), D = max(d, d_v) (the attention core's width: the narrower of
q/k and v is zero-padded, megalite/mla/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megalite.fp8.costs import Gemm, fp8_filter


class MLAShape(Protocol):
    """MLA's widths (`megalite.mla.config.MLAConfig` and `MLADims` satisfy it)."""

    @property
    def q_lora_rank(self) -> int: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...


@dataclass(frozen=True)
class MLADims:
    """MLA's widths as a frozen value (the cost model's `ModelDims.mla`)."""

    kv_lora_rank: int
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128

    @classmethod
    def of(cls, m: MLAShape) -> MLADims | None:
        """The widths of an `[mla]` section, None when MLA is off (kv_lora_rank 0)."""
        if m.kv_lora_rank <= 0:
            return None
        return cls(m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim)


def attention_weights(hidden: int, heads: int, m: MLAShape) -> tuple[int, int]:
    """(weights split over TP by heads: q_b (or q), kv_b, out; weights replicated over TP: q_a, kv_a).

    q_b: r_q x H·d (q: h x H·d), kv_b: r_kv x H·(d_n + d_v), out: H·d_v x h; q_a: h x r_q, kv_a: h x (r_kv + d_r)."""
    d = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = (m.q_lora_rank or hidden) * heads * d
    split = q + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * hidden
    replicated = hidden * m.q_lora_rank + hidden * (m.kv_lora_rank + m.qk_rope_head_dim)
    return split, replicated


def attention_params(hidden: int, heads: int, m: MLAShape) -> int:
    """Every parameter of one MLA attention: its weights and the two latent RMSNorms (r_q + r_kv)."""
    split, replicated = attention_weights(hidden, heads, m)
    return split + replicated + m.q_lora_rank + m.kv_lora_rank


def core_width(m: MLAShape) -> int:
    """D: the head width the attention core runs at."""
    return max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)


def attention_width(heads: int, m: MLAShape) -> float:
    """The H·Q of PaLM's attention term 12·L·H·Q·s for MLA's core: QK^T at d and AV at d_v average H·(d + d_v)/2."""
    return heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2


def core_flops_per_token(seq_len: int, heads: int, m: MLAShape) -> tuple[float, float]:
    """(needed, executed) forward FLOPs of one layer's attention core per token, full (unmasked) count as PaLM:
    QK^T 2·s·H·d plus AV 2·s·H·d_v needed; executed at the padded width, 4·s·H·D."""
    d = m.qk_nope_head_dim + m.qk_rope_head_dim
    return 2.0 * seq_len * heads * (d + m.v_head_dim), 4.0 * seq_len * heads * core_width(m)


def kv_cache_bytes_per_token(num_layers: int, m: MLAShape, bytes_per_element: int) -> int:
    """The compressed KV cache per generated token: (r_kv + d_r) per layer (DeepSeek-V2 section 2.1.2)."""
    return num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * bytes_per_element


def expanded_kv_cache_bytes_per_token(num_layers: int, heads: int, m: MLAShape, bytes_per_element: int) -> int:
    """What a cache of the up-projected keys and values would hold instead: H·(d + d_v) per layer."""
    return num_layers * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * bytes_per_element


def activation_bytes_per_layer(tokens: int, h: int, heads: int, m: MLAShape, kv_len: int, tp: int = 1,
                               sp: bool = False, recompute: str = "none") -> float:
    """One MLA layer's activation bytes for `tokens` = s·b tokens of a micro-batch, each attending over `kv_len`
    keys (s, unless context parallel), Korthikanti et al. 2022's accounting (megalite/perfmodel/activations.py)
    with its attention replaced, for 16-bit activations (the caller scales for others):
      as the dense layer: the norms' and the attention and MLP inputs 8·sbh and the two dropout masks 2·sbh
        (/t under SP), the MLP 16·sbh/t;
      the latents, replicated (every TP rank computes them on the whole sequence): q_a's output and its norm's
        4·sb·r_q, kv_a's output 2·sb·(r_kv + d_r) and its norm's 2·sb·r_kv;
      per head (/t): q, k, v at the core's width 6·sb·H·D, the output projection's input 2·sb·H·d_v;
      the scores 5·H·s·kv_len·b/t, dropped by selective recompute.
    Full recompute keeps only the layer input 2·sbh (/t under SP)."""
    sb = float(tokens)
    sbh = sb * h
    if recompute == "full":
        return 2.0 * sbh / (tp if sp else 1)
    dense = 10.0 * sbh / (tp if sp else 1) + 16.0 * sbh / tp
    latents = sb * (4.0 * m.q_lora_rank + 2.0 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2.0 * m.kv_lora_rank)
    per_head = sb * heads * (6.0 * core_width(m) + 2.0 * m.v_head_dim) / tp
    scores = 0.0 if recompute == "selective" else 5.0 * heads * sb * kv_len / tp
    return dense + latents + per_head + scores


def mla_gemms(hidden: int, heads: int, mla: MLAShape, min_dim: int) -> list[Gemm]:
    """MLA's parallel linears (megalite/mla/attention.py) and the FP8 filter's choice for each, for the block
    recipes' layout rule (megalite/fp8/checks.py): q_b (or q without a query latent) and kv_b column-parallel, split
    by heads; out row-parallel over the heads' outputs. q_a and kv_a are replicated and stay in the run dtype, so
    no block of theirs is split."""
    qk, kv = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    q = ("attn.q_b", mla.q_lora_rank) if mla.q_lora_rank else ("attn.q", hidden)
    shapes = [(q[0], q[1], (heads * qk,), "column"), ("attn.kv_b", mla.kv_lora_rank, (heads * kv,), "column"),
              ("attn.out", heads * mla.v_head_dim, (hidden,), "row")]
    return [Gemm(n, i, o, k, fp8_filter(n, i, list(o), min_dim)) for n, i, o, k in shapes]
