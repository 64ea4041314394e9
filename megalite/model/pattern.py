"""The layer pattern: what each layer of the model is, resolved once from the config into a typed spec.

A layer is a mixer (its token-mixing part: full or sliding-window attention, or a linear one: Gated DeltaNet) and an MLP. The config names
the mixers in Hugging Face's vocabulary (`model.layer_types`, transformers' `layer_types`: "full_attention",
"sliding_attention", "linear_attention" as Qwen3-Next / Qwen3.5; Megatron's hybrid_override_pattern is the same idea); a list shorter than the model is a
period, repeated (`["sliding_attention"] * 5 + ["full_attention"]` is Gemma 3's 5 local : 1 global). Every consumer
(the block, the pipeline partition, the estimator, generation's KV cache) reads `layer_specs`, never the raw
fields: one home, so a mixer kind is one entry in `MIXERS` and one branch where a block builds its mixer.

Nemotron-H (and Megatron's hybrid models) make each layer ONE part instead: a Mamba2 layer, an attention layer or an
MLP layer, each a pre-norm residual block (transformers' `layers_block_type`, Megatron's hybrid_override_pattern
"M-M*-": M mamba, * attention, - MLP, E MoE). megalite names those kinds "mamba", "attention" and "mlp" in the same
`model.layer_types`: a layer of kind "mamba" (Mamba2, megalite/recurrent/mamba2.py) or "attention" (full causal
attention) has no MLP, a layer of kind "mlp" has no mixer (its MLP is the dense one, or MoE where the MoE config
puts experts). `LayerSpec.has_mixer` / `has_mlp` say it; the block builds only its parts, and the pipeline partition
balances each kind by its parts' cost (`layer_costs`; the estimator does not read it yet). A period may mix both styles (["mamba", "mlp",
"full_attention"] is a mamba layer, an MLP layer and an attention layer with its MLP).

Torch-free: config validation and the cost model read it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.recurrent.costs import RecurrentDims, chunked_flops, matmul_weights, ssd_chunked_flops

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
# Kimi Delta Attention (Kimi Linear): transformers calls these layers "linear_attention" too (its config's
# linear_attn_config.kda_layers); megalite names the kind, since Qwen3.5's linear_attention is Gated DeltaNet.
KIMI_DELTA = "kimi_delta_attention"
LINEAR_MIXERS = (LINEAR, KIMI_DELTA)  # the delta-rule mixers (megalite/recurrent): no KV cache, no RoPE
MIXERS: tuple[str, ...] = (FULL, SLIDING, LINEAR, KIMI_DELTA)  # the `layer_types` names this implementation computes
# Nemotron-H's one-part layers (above): two mixers without an MLP, an MLP without a mixer
MAMBA, ATTENTION, MLP_ONLY = "mamba", "attention", "mlp"
MIXER_ONLY = (MAMBA, ATTENTION)
MIXERS += (MAMBA, ATTENTION, MLP_ONLY)
MLP_KINDS = ("auto", "swiglu", "geglu", "clamped_swiglu", "gelu", "relu2")


def has_linear(m: Any) -> bool:
    """Some layer of model config `m` is a delta-rule (linear) mixer."""
    return any(t in LINEAR_MIXERS for t in m.layer_types)
OUTPUT_GATES = ("none", "head", "element")


# The fields of the layer pattern and the variants at their defaults (the model before them): a checkpoint records
# each one that differs (index.json "model", `variant_info`), so a run loading it builds the same layers.
VARIANT_DEFAULTS: dict[str, Any] = dict(
    layer_types=[], sliding_window=0, rope_local_theta=0.0, rope_fraction=1.0, nope_layers=[], attn_sinks=False,
    attn_output_gate="none", attn_softcap=0.0, final_softcap=0.0, query_pre_attn_scalar=0.0, attn_bias=False,
    sandwich_norm=False, embed_scale=False, mlp="auto", swiglu_limit=7.0, swiglu_alpha=1.702, mlp_bias=False,
    rope_truncate=True, linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
    linear_value_head_dim=0, linear_conv_kernel_dim=4)
VARIANT_DEFAULTS.update(mamba_num_heads=0, mamba_head_dim=0, mamba_n_groups=1, mamba_state_size=128,
                        mamba_conv_kernel=4)
# megalite.recurrent.chunked.CHUNK, the chunk the linear layers run by (here without importing torch; a test holds
# the two equal)
LINEAR_CHUNK = 64


@dataclass(frozen=True)
class LinearDims:
    """A linear_attention layer's shape, the model.linear_* fields resolved (0 = derived)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    def recurrent(self) -> RecurrentDims:
        """The recurrence's and the layer's shape as its cost formulas take it (megalite/recurrent/costs.py)."""
        return RecurrentDims(self.value_heads, self.key_head_dim, self.value_head_dim,
                             2 * self.key_dim + self.value_dim, self.conv_kernel, self.key_heads)


@dataclass(frozen=True)
class MambaDims:
    """A mamba layer's shape, the model.mamba_* fields resolved (0 = derived)."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """x, B and C: what the conv mixes."""
        return self.heads * self.head_dim + 2 * self.groups * self.state_size


def mamba_dims(m: Any, head_dim: int) -> MambaDims:
    """Model config `m`'s mamba layers' shape; `head_dim` is the attention's resolved head width."""
    return MambaDims(m.mamba_num_heads or m.num_heads, m.mamba_head_dim or head_dim, m.mamba_n_groups,
                     m.mamba_state_size, m.mamba_conv_kernel)


def linear_dims(m: Any, head_dim: int) -> LinearDims:
    """Model config `m`'s linear layers' shape; `head_dim` is the attention's resolved head width."""
    key_heads = m.linear_num_key_heads or m.num_heads
    key_dim = m.linear_key_head_dim or head_dim
    return LinearDims(key_heads, m.linear_num_value_heads or key_heads, key_dim, m.linear_value_head_dim or key_dim,
                      m.linear_conv_kernel_dim)


def variant_info(m: Any) -> dict[str, Any]:
    """The layer-pattern and variant fields of model config `m` that differ from their defaults."""
    own = {"mlp": "swiglu" if m.arch == "llama" else "gelu"}  # `auto` resolved (config.derive): still the default
    return {k: getattr(m, k) for k, default in VARIANT_DEFAULTS.items()
            if getattr(m, k) != default and getattr(m, k) != own.get(k)}


def gated_mlp(arch: str, mlp: str) -> bool:
    """The MLP takes a gate and an up projection (its fused up linear is 2F wide)."""
    return mlp not in ("gelu", "relu2") if mlp != "auto" else arch == "llama"


def gate_width(num_heads: int, head_dim: int, gate: str) -> int:
    """Columns the attention output gate adds to the q/k/v projection: per head or per element; 0 without."""
    return {"head": num_heads, "element": num_heads * head_dim}.get(gate, 0)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's mixer. `window`: a sliding_attention layer's W (query i sees keys i - W < j <= i), None for
    full causal attention; `rope_theta` and `rope_fraction` (the share of each head's dims RoPE rotates, the first
    ones as transformers' partial_rotary_factor; 0 = NoPE) are this layer's."""

    mixer: str = FULL
    window: int | None = None
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0

    @property
    def has_mixer(self) -> bool:
        """Every kind but Nemotron-H's "mlp" layers mixes tokens."""
        return self.mixer != MLP_ONLY

    @property
    def has_mlp(self) -> bool:
        """Nemotron-H's "mamba" and "attention" layers have no MLP."""
        return self.mixer not in MIXER_ONLY

    def rotary_dim(self, head_dim: int) -> int:
        """Dims of each head RoPE rotates (transformers: int(head_dim * partial_rotary_factor)); 0 = NoPE."""
        return int(head_dim * self.rope_fraction)


def mixer_of(m: Any, index: int) -> str:
    """Layer `index`'s mixer: its entry of model.layer_types repeated as a period (full_attention if empty).
    Layers past num_layers (the MTP modules' blocks) continue the period."""
    types = list(m.layer_types)
    return types[index % len(types)] if types else FULL


def layer_spec(m: Any, index: int) -> LayerSpec:
    """The spec of global layer `index` of model config `m` (a `megalite.model.spec.ModelSpec`)."""
    mixer = mixer_of(m, index)
    sliding = mixer == SLIDING
    theta = m.rope_local_theta if sliding and m.rope_local_theta else m.rope_theta
    fraction = 0.0 if index in m.nope_layers else m.rope_fraction
    return LayerSpec(mixer, m.sliding_window if sliding else None, theta, fraction)


def layer_specs(m: Any) -> tuple[LayerSpec, ...]:
    """Every layer's spec, in model order."""
    return tuple(layer_spec(m, i) for i in range(m.num_layers))


def mlp_kind(m: Any) -> str:
    """The MLP's activation: model.mlp, or the arch's own (llama: swiglu, gpt2: gelu) for auto."""
    return str(m.mlp) if m.mlp != "auto" else "swiglu" if m.arch == "llama" else "gelu"



def has_attention_bias(m: Any) -> bool:
    """Biases on q, k, v and o: gpt2 always, llama when model.attn_bias (gpt-oss)."""
    return m.arch == "gpt2" or bool(m.attn_bias)


def has_mlp_bias(m: Any) -> bool:
    """Biases on the dense MLP's linears: gpt2 always, llama when model.mlp_bias (gpt-oss)."""
    return m.arch == "gpt2" or bool(m.mlp_bias)


def softmax_scale(m: Any) -> float | None:
    """The attention softmax scale: query_pre_attn_scalar^-1/2 (Gemma), None = 1/sqrt(head_dim)."""
    return float(m.query_pre_attn_scalar) ** -0.5 if m.query_pre_attn_scalar else None


def is_uniform(m: Any) -> bool:
    """Every layer is the same (the model before layer patterns): full attention, one RoPE."""
    return len(set(layer_specs(m))) <= 1


def pattern_problems(m: Any, head_dim: int) -> list[str]:
    """One line per bad layer-pattern or variant field of model config `m` (config validation calls it);
    `head_dim` is the resolved head width."""
    out: list[str] = []
    bad = [t for t in m.layer_types if t not in MIXERS]
    if bad:
        out.append(f"model.layer_types: {bad[0]!r} is not a mixer megalite has; expected one of {', '.join(MIXERS)}")
    if len(m.layer_types) > m.num_layers > 0:
        out.append(f"model.layer_types has {len(m.layer_types)} entries for model.num_layers={m.num_layers}: give "
                   "one per layer, or a shorter period that repeats")
    sliding = SLIDING in m.layer_types
    if sliding and m.sliding_window < 1:
        out.append(f"model.sliding_window={m.sliding_window}: sliding_attention layers need a window W >= 1 "
                   "(keys seen, the query's own included)")
    if not sliding and m.sliding_window:
        out.append(f"model.sliding_window={m.sliding_window} is set but no layer is sliding_attention: add "
                   "'sliding_attention' to model.layer_types or set sliding_window=0")
    if m.rope_local_theta < 0 or (m.rope_local_theta and not sliding):
        out.append(f"model.rope_local_theta={m.rope_local_theta} applies to sliding_attention layers only and must "
                   "be > 0 (0 = rope_theta)")
    if not 0.0 <= m.rope_fraction <= 1.0:
        out.append(f"model.rope_fraction={m.rope_fraction} must be in [0, 1] (0 = NoPE, 1 = every dim rotated)")
    elif int(head_dim * m.rope_fraction) % 2:
        out.append(f"model.rope_fraction={m.rope_fraction} rotates int({head_dim} x {m.rope_fraction}) = "
                   f"{int(head_dim * m.rope_fraction)} dims of each head: RoPE rotates pairs, make it even")
    if any(not 0 <= i < m.num_layers for i in m.nope_layers):
        out.append(f"model.nope_layers={list(m.nope_layers)}: each must be a layer index in [0, {m.num_layers})")
    out += _linear_problems(m, head_dim)
    out += _mamba_problems(m, head_dim)
    if m.arch != "llama" and (m.rope_fraction != 1.0 or m.nope_layers or m.rope_local_theta):
        out.append("model.rope_fraction, nope_layers and rope_local_theta need model.arch=llama (gpt2 has no RoPE)")
    for key in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        if getattr(m, key) < 0:
            out.append(f"model.{key}={getattr(m, key)} must be > 0 (0 = off)")
    if m.attn_output_gate not in OUTPUT_GATES:
        out.append(f"model.attn_output_gate={m.attn_output_gate!r}: expected one of {', '.join(OUTPUT_GATES)}")
    if m.mlp not in MLP_KINDS:
        out.append(f"model.mlp={m.mlp!r}: expected one of {', '.join(MLP_KINDS)}")
    if m.mlp == "clamped_swiglu" and not (m.swiglu_limit > 0 and m.swiglu_alpha > 0):
        out.append(f"model.swiglu_limit={m.swiglu_limit} and model.swiglu_alpha={m.swiglu_alpha} must be > 0")
    return out


def _linear_problems(m: Any, head_dim: int) -> list[str]:
    """The model.linear_* fields, one line each bad one."""
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    out = [f"model.{k}={getattr(m, k)} must be >= 0 (0 = derived)" for k in names if getattr(m, k) < 0]
    if m.linear_conv_kernel_dim < 1:
        out.append(f"model.linear_conv_kernel_dim={m.linear_conv_kernel_dim} must be >= 1 (Qwen3.5: 4)")
    d = linear_dims(m, head_dim)
    if not out and d.key_heads and d.value_heads % d.key_heads:
        out.append(f"model.linear_num_value_heads={d.value_heads} must be a multiple of linear_num_key_heads="
                   f"{d.key_heads} (each key head is read by value_heads / key_heads value heads)")
    if has_linear(m) and m.arch != "llama":
        out.append("model.layer_types: linear_attention layers need model.arch=llama")
    return out


def _mamba_problems(m: Any, head_dim: int) -> list[str]:
    """The model.mamba_* fields, one line each bad one (when a layer is a mamba layer)."""
    if MAMBA not in m.layer_types:
        return []
    names = ("mamba_num_heads", "mamba_head_dim")
    out = [f"model.{k}={getattr(m, k)} must be >= 0 (0 = derived)" for k in names if getattr(m, k) < 0]
    out += [f"model.{k}={getattr(m, k)} must be >= 1" for k in ("mamba_n_groups", "mamba_state_size",
                                                                 "mamba_conv_kernel") if getattr(m, k) < 1]
    d = mamba_dims(m, head_dim)
    if not out and d.heads % d.groups:
        out.append(f"model.mamba_num_heads={d.heads} must be a multiple of mamba_n_groups={d.groups} (each group's "
                   "B and C are read by heads / groups heads)")
    if m.arch != "llama":
        out.append("model.layer_types: mamba layers need model.arch=llama")
    return out


def variant_layout_problems(m: Any, tp: int, mla: bool, mtp_layers: int) -> list[str]:
    """The variant fields against the parallel layout and the other attention features, one line each."""
    out: list[str] = []
    if m.attn_output_gate != "none" and m.num_heads % max(tp, 1):
        out.append(f"model.attn_output_gate needs num_heads={m.num_heads} divisible by parallel.tp={tp} (the gate "
                   "is split with its heads)")
    variant = (list(m.layer_types) != [] or m.attn_sinks or m.attn_output_gate != "none" or m.attn_softcap
               or m.query_pre_attn_scalar or m.rope_fraction != 1.0 or m.nope_layers or m.attn_bias)
    if has_linear(m) and m.num_heads and m.hidden_size:
        d = linear_dims(m, m.head_dim or m.hidden_size // m.num_heads)
        if d.key_heads % max(tp, 1) or d.value_heads % max(tp, 1):
            out.append(f"linear_attention layers need linear_num_key_heads={d.key_heads} and linear_num_value_heads="
                       f"{d.value_heads} divisible by parallel.tp={tp} (each rank keeps whole key heads with the "
                       "value heads that read them)")
    if MAMBA in m.layer_types and m.mamba_n_groups % max(tp, 1):
        out.append(f"mamba layers need model.mamba_n_groups={m.mamba_n_groups} divisible by parallel.tp={tp} (each "
                   "rank keeps whole groups of B and C with the heads that read them)")
    if mla and variant:
        out.append("model.layer_types and the attention variants (sinks, gate, softcap, query_pre_attn_scalar, "
                   "rope_fraction, nope_layers, attn_bias) apply to grouped-query attention, not MLA ([mla])")
    if mtp_layers and not is_uniform(m):
        out.append("multi-token prediction ([mtp]) with a layer pattern of unequal layers is not supported yet: "
                   "set mtp.num_layers=0")
    return out


def layer_costs(m: Any) -> list[float]:
    """Each layer's training FLOPs per token, up to a common factor: 2 x its matmul weights (a MoE layer: the top_k
    experts a token goes through, the shared ones and the router) + 4 x heads x head_dim x the keys each query sees
    (a sliding layer: sum_i min(i + 1, W) / s, what it computes; `attention.costs.visible_pairs`); a linear layer:
2 x its weights + the chunked recurrence's forward FLOPs per token (`recurrent.costs.chunked_flops`); a mamba layer
    likewise with SSD's (`recurrent.costs.ssd_chunked_flops`); Nemotron-H's one-part layers count only their part (a
    mamba or attention layer no MLP, an mlp layer no mixer). What the pipeline partition balances
    (`balanced_counts`) when layers differ."""
    from megalite.attention.costs import visible_pairs

    h, nh, nkv, s = m.hidden_size, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len
    hd = m.head_dim or h // nh
    attn = h * (nh * hd + 2 * nkv * hd) + nh * hd * h + h * gate_width(nh, hd, m.attn_output_gate)
    width = 3 if gated_mlp(m.arch, m.mlp) else 2
    d = linear_dims(m, hd).recurrent()
    # Gated DeltaNet: in_proj (q, k, v, z, b, a), out_proj, the depthwise conv; the recurrence's chunked form
    linear = matmul_weights(d, h)
    rule = chunked_flops(d, 1, s, LINEAR_CHUNK) / s
    # Kimi Delta Attention: in_proj (q, k, v, b), the low-rank gates (rank K: f_a, f_b to H K, g_a, g_b to H V),
    # out_proj, the conv (the per-channel decay's extra cost in the recurrence is not counted)
    ld, conv = linear_dims(m, hd), d.conv_channels
    kimi = (h * (conv + ld.value_heads) + 2 * h * ld.key_head_dim + ld.key_head_dim * (ld.value_heads * ld.key_head_dim
            + ld.value_dim) + ld.value_dim * h + conv * ld.conv_kernel)
    # Mamba2: in_proj (z, x, B, C, dt), out_proj, the conv (+ bias); SSD's chunked form (no erase: no solve)
    md = mamba_dims(m, hd)
    inner = md.heads * md.head_dim
    mamba = h * (inner + md.conv_channels + md.heads) + inner * h + md.conv_channels * (md.conv_kernel + 1)
    ssd = ssd_chunked_flops(RecurrentDims(md.heads, md.state_size, md.head_dim, md.conv_channels, md.conv_kernel),
                            1, s, LINEAR_CHUNK) / s
    moe = m.moe.resolved(m.ffn_hidden_size)
    out = []
    for i, spec in enumerate(layer_specs(m)):
        if moe is not None and moe.is_moe_layer(i):
            mlp = width * h * (moe.top_k * moe.ffn_hidden_size + moe.shared_experts * moe.shared_ffn_hidden_size)
            mlp += h * moe.experts
        else:
            mlp = width * h * m.ffn_hidden_size
        if not spec.has_mlp:
            mlp = 0
        if spec.mixer in LINEAR_MIXERS:
            out.append(2.0 * ((kimi if spec.mixer == KIMI_DELTA else linear) + mlp) + rule)
            continue
        if spec.mixer in (MAMBA, MLP_ONLY):
            out.append(2.0 * (mamba + mlp) + ssd if spec.mixer == MAMBA else 2.0 * mlp)
            continue
        keys = visible_pairs(s, spec.window) / s
        out.append(2.0 * (attn + mlp) + 4.0 * nh * hd * keys)
    return out
