"""How many parameters megalite's GPT has, from its dimensions alone (no torch): config validation checks
a model fits before building it, and the cost model (megalite/perfmodel) sizes memory and FLOPs from it.
tests/test_flops_estimate.py holds it equal to a built model's count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.mla.costs import MLAShape, attention_params
from megalite.model.pattern import (LINEAR, gate_width, gated_mlp, has_attention_bias, has_mlp_bias, layer_specs,
                                    linear_dims)
from megalite.recurrent.costs import layer_params
from megalite.moe.settings import moe_layers, moe_settings


@dataclass(frozen=True)
class ParamShape:
    """The dimensions the parameter count depends on (resolved: no "derive me" zeros)."""

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tie: bool
    head_dim: int | None = None  # None: hidden / num_heads
    mla: MLAShape | None = None  # multi-head latent attention's widths (llama only); None: off


def count_params(shape: ParamShape) -> int:
    """Parameters of megalite's GPT (unpadded vocabulary, no parallelism).

    llama, per layer: q and o h x h each, k and v h x (kv·head_dim) each; SwiGLU 3·h·ffn;
    two RMSNorm weights. Then a final RMSNorm, the V x h embedding and an untied head unless `tie`.
    gpt2 adds biases (qkv, out, both MLP linears), LayerNorm weight+bias, a 2·h·ffn GeLU MLP
    and learned positions (s x h); its head is normally tied. `head_dim` defaults to hidden/heads.
    With `mla` (multi-head latent attention, llama only) the attention is MLA's (`megalite.mla.costs`).
    """
    arch, num_layers, hidden, ffn, vocab = shape.arch, shape.num_layers, shape.hidden, shape.ffn, shape.vocab
    num_heads, num_kv_heads, seq_len, tie, head_dim = (shape.num_heads, shape.num_kv_heads, shape.seq_len, shape.tie,
                                                       shape.head_dim)
    hd = hidden // num_heads if head_dim is None else head_dim
    q, kv = num_heads * hd, num_kv_heads * hd
    mla = shape.mla
    attn = hidden * (q + 2 * kv) + q * hidden if mla is None else attention_params(hidden, num_heads, mla)
    if arch == "llama":
        layer = attn + 3 * hidden * ffn + 2 * hidden
        outside = hidden + vocab * hidden
    else:
        layer = attn + (q + 2 * kv) + hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
        outside = 2 * hidden + vocab * hidden + seq_len * hidden
    return num_layers * layer + outside + (0 if tie else vocab * hidden)


def count_model_params(m: Any, mla: MLAShape | None = None) -> int:
    """Parameters of model config `m` (resolved), its experts and its attention / MLP variants included
    (`variant_params`): each MoE layer's dense MLP replaced by a router (E x h, + E with moe.router_bias), the
    shared experts' gate (h, with moe.shared_gate), E routed experts (a gated MLP 3·h·F, else 2·h·F; with model.mlp_bias each expert's biases) and the shared experts' fused
    MLP (n_s·F_s wide, a dense MLP with the dense MLP's biases). The MoE dims are read by `moe_settings` only
    (`m.moe`); `mla`: the attention is multi-head latent attention of these widths."""
    dense = count_params(ParamShape(m.arch, m.num_layers, m.hidden_size, m.num_heads, max(1, m.num_kv_heads),
                                    m.ffn_hidden_size, max(m.vocab_size, 1), m.seq_len, bool(m.tie_embeddings),
                                    m.head_dim or None, mla)) + m.num_layers * variant_params(m) + linear_params_delta(m)
    s = moe_settings(m)
    if s is None:
        return dense
    h, gated, bias = m.hidden_size, gated_mlp(m.arch, m.mlp), has_mlp_bias(m)
    experts = s.experts * _mlp_params(h, s.ffn_hidden_size, gated, bool(m.mlp_bias))
    shared = _mlp_params(h, s.shared_experts * s.shared_ffn_hidden_size, gated, bias) if s.shared_experts else 0
    per_layer = h * s.experts + (s.experts if s.router_bias else 0) + experts + shared + (h if s.shared_gate else 0)
    return dense + len(moe_layers(m)) * (per_layer - _mlp_params(h, m.ffn_hidden_size, gated, bias))


def _mlp_params(hidden: int, ffn: int, gated: bool, bias: bool) -> int:
    """A dense MLP's: up (gate and up when gated) and down, with their biases."""
    return (3 if gated else 2) * hidden * ffn + (((2 if gated else 1) * ffn + hidden) if bias else 0)


def variant_params(m: Any) -> int:
    """Parameters one layer of model config `m` has beyond `count_params`'s (llama: no biases, SwiGLU; gpt2: biases,
    GeLU): q/k norm, q/k/v/o biases on llama (model.attn_bias), the output gate's projection (and its bias), the sinks, the
    sandwich norms, and the dense MLP of another kind (model.mlp) or with biases (model.mlp_bias). 0 for the
    default fields (megalite/model/pattern.py)."""
    h, gpt2 = m.hidden_size, m.arch == "gpt2"
    extra = attention_variant_params(m) + ((4 if gpt2 else 2) * h if m.sandwich_norm else 0)
    f = m.ffn_hidden_size
    before = 2 * h * f + f + h if gpt2 else 3 * h * f
    return extra + _mlp_params(h, f, gated_mlp(m.arch, m.mlp), has_mlp_bias(m)) - before


def attention_variant_params(m: Any) -> int:
    """The attention's own parameters beyond `count_params`'s q/k/v/o: llama's q/k/v/o biases, the output gate's
    projection (and its bias), the sinks, the q/k norms."""
    h, nh, gpt2 = m.hidden_size, m.num_heads, m.arch == "gpt2"
    hd = m.head_dim or h // max(nh, 1)
    extra = (nh * hd + 2 * max(1, m.num_kv_heads) * hd + h) if (m.attn_bias and not gpt2) else 0
    gate = gate_width(nh, hd, m.attn_output_gate)
    extra += h * gate + (gate if has_attention_bias(m) else 0)
    extra += nh if m.attn_sinks else 0
    return extra + (2 * hd if m.qk_norm else 0)  # q_norm and k_norm, one [head_dim] weight each


def linear_params_delta(m: Any) -> int:
    """What the linear_attention layers (Gated DeltaNet) change: each has the layer's parameters
    (`recurrent.costs.layer_params`) where the others have the attention's (q/k/v/o and its variants)."""
    linear = sum(spec.mixer == LINEAR for spec in layer_specs(m))
    if not linear:
        return 0
    h, nh = m.hidden_size, m.num_heads
    hd = m.head_dim or h // max(nh, 1)
    attn = h * (nh * hd + 2 * max(1, m.num_kv_heads) * hd) + nh * hd * h + attention_variant_params(m)
    return linear * (layer_params(linear_dims(m, hd).recurrent(), h) - attn)
