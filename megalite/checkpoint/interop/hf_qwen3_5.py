"""Hugging Face Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM both ways: Gated DeltaNet
(`linear_attention`) layers beside gated full-attention layers (q/k norm, the per-element output gate, partial
RoPE), zero-centred RMSNorms, and in the MoE models a shared expert behind a sigmoid gate.

Names (megalite's global names on the left, transformers' on the right; p = `model.layers.i.`):

  layers.i.norm1 / norm2.weight        p input_layernorm / post_attention_layernorm.weight  (1 + w)
  full_attention layers
  layers.i.attn.qkv.weight             p self_attn.{q,k,v}_proj.weight   rows [q; k; v; gate] <- q_proj [q; gate]
                                        (q_proj interleaves per head: head h's query rows, then its gate rows)
  layers.i.attn.out.weight             p self_attn.o_proj.weight
  layers.i.attn.{q,k}_norm.weight      p self_attn.{q,k}_norm.weight     (1 + w)  [head_dim]
  linear_attention layers (a = attn.gdn.; t = linear_attn.)
  layers.i.a in_proj.weight            p t in_proj_qkv, in_proj_z, in_proj_b, in_proj_a        rows [q; k; v; z; b; a]
                                       Qwen3-Next: p t in_proj_qkvz, in_proj_ba, grouped per key head (below)
  layers.i.a conv_weight [C, W]        p t conv1d.weight [C, 1, W]
  layers.i.a A_log / dt_bias / out_proj.weight    p t A_log / dt_bias / out_proj.weight
  layers.i.a norm_weight               p t norm.weight               (w: the gated norm is NOT zero-centred)
  dense layers   layers.i.mlp.up / down.weight    p mlp.{gate,up}_proj / down_proj.weight   rows [gate; up]
  MoE layers     layers.i.mlp.router.weight       p mlp.gate.weight
                 layers.i.mlp.experts.up / down   p mlp.experts.gate_up_proj / down_proj (the hub's per-expert
                                                  mlp.experts.j.{gate,up,down}_proj stacked, as Qwen3-MoE's)
                 layers.i.mlp.shared.up / down    p mlp.shared_expert.{gate,up}_proj / down_proj.weight
                 layers.i.mlp.shared_gate.weight  p mlp.shared_expert_gate.weight   [1, h]
  embedding / final_norm / head        model.embed_tokens / model.norm (1 + w) / lm_head (absent when tied)

Zero-centred norms: transformers' Qwen3.5 / Qwen3-Next RMSNorm multiplies by (1 + w) in fp32, megalite's by w: the
import stores 1 + w, the export w - 1 (as Gemma 3's, megalite/checkpoint/interop/hf_gemma3.py). Qwen3-Next's
in_proj_qkvz holds, per key head g, [q_g (K); k_g (K); v of its r = H/Hk value heads (r V); their z (r V)] and
in_proj_ba per key head [b (r); a (r)]: the import regroups them into megalite's [q; k; v; z] and [b; a], the export
back. RoPE: Qwen3.5's multimodal RoPE (mrope_section) rotates by the text position in all three sections for text
(transformers' position_ids expanded to 3 equal rows): plain RoPE on the first partial_rotary_factor of each head.
Only the default RoPE type imports (a scaled one with partial RoPE is not tested against transformers).

The hub's multi-token-prediction weights (`mtp.*`) are dropped by transformers' modeling (its
_keys_to_ignore_on_load_unexpected), so the import does not read them either and says so in one line. The hub's
Qwen3.5 releases are Qwen3_5(Moe)ForConditionalGeneration (model_type qwen3_5 / qwen3_5_moe): their text_config and
`model.language_model.*` weights import as the ForCausalLM model (as transformers' own conversion does); the vision
tower is left behind. Export: no MoE -> Qwen3_5ForCausalLM; a MoE on every layer with the top-k renormalised ->
Qwen3_5MoeForCausalLM; else (dense layers by decoder_sparse_step, or norm_topk_prob false) Qwen3NextForCausalLM.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch

from megalite.checkpoint.interop import hf, hf_moe
from megalite.checkpoint.interop.hf_pattern import FULL, Need, ends, head_dim, layer_types, off, shapes, unmet
from megalite.errors import CheckpointError
from megalite.model.pattern import LINEAR, VARIANT_DEFAULTS, LinearDims, linear_dims

ARCHS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
         "qwen3_next": "Qwen3NextForCausalLM"}
COMPOSITE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # the hub's: text_config inside
NEXT, MOE = "qwen3_next", "qwen3_5_moe_text"
# transformers' config defaults these families share, for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {"head_dim": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
                            "tie_word_embeddings": False, "max_position_embeddings": 32768,
                            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1,
                            "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "num_key_value_heads": 2}
_LANGUAGE = "model.language_model."  # the composite model's prefix of the text model's weights


# ----------------------------------------------------------------------------------------- config.json
def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with DEFAULTS filled in (a composite's text_config, its model_type the text one)."""
    kind = cfg.get("model_type")
    if kind in COMPOSITE:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"this {kind} config cannot be imported: it has no text_config object")
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        cfg = {**text, "model_type": COMPOSITE[kind], "tie_word_embeddings": tie}
    return {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}


def _period(types: list[str]) -> list[str]:
    """megalite's model.layer_types for transformers' list: the shortest period, [] when every layer is full."""
    if set(types) == {FULL}:
        return []
    n = len(types)
    return types[:next(p for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n)))]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model info for a qwen3_5_text / qwen3_5_moe_text / qwen3_next config.json (or a composite's)."""
    c = _text(cfg)
    kind, layers = c["model_type"], c["num_hidden_layers"]
    name = ARCHS[kind]
    full_every = c.get("full_attention_interval", 4)  # transformers' default pattern: 3 linear then 1 full
    types = c.get("layer_types") or [LINEAR if (i + 1) % full_every else FULL for i in range(layers)]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    fraction = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)) if isinstance(rope, dict) else 0
    hd = c["head_dim"]
    moe = kind != "qwen3_5_text" and c.get("num_experts", 0) > 0
    bad = [what for what, ok in (
        ("hidden_act must be silu", c["hidden_act"] == "silu"),
        (f"layer_types must list 'linear_attention' or 'full_attention' for each of the {layers} layers, got "
         f"{types!r}", isinstance(types, list) and len(types) == layers and set(types) <= {LINEAR, FULL}),
        (f"rope_parameters={rope!r} must be an object", isinstance(rope, dict)),
        ("only the default RoPE imports (rope_type default; a scaled RoPE with partial_rotary_factor is not tested "
         "against transformers)", isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default"))
         == "default"),
        (f"head_dim={hd!r} must be a positive integer", _int(hd)),
        (f"partial_rotary_factor={fraction!r} must be in (0, 1] and rotate an even number of dims of each head",
         isinstance(fraction, (int, float)) and 0 < fraction <= 1 and _int(hd) and int(hd * fraction) % 2 == 0),
        *((f"{k}={c[k]!r} must be a positive integer", _int(c[k])) for k in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "decoder_sparse_step")),
        ("mlp_only_layers must be empty (dense layers only through decoder_sparse_step)", not c.get("mlp_only_layers")),
        ) if not ok]
    if bad:
        raise CheckpointError(f"this {name} config cannot be imported: {'; '.join(bad)}")
    info: dict[str, Any] = {
        "arch": "llama", "num_layers": layers, "hidden_size": c["hidden_size"], "num_heads": c["num_attention_heads"],
        "num_kv_heads": c["num_key_value_heads"], "vocab_size": c["vocab_size"], "seq_len": c["max_position_embeddings"],
        "ffn_hidden_size": c.get("intermediate_size") or c.get("moe_intermediate_size"),
        "make_vocab_divisible_by": 64, "tie_embeddings": bool(c["tie_word_embeddings"]), "norm_eps": c["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)), "qk_norm": True,
        "attn_output_gate": "element", "layer_types": _period(types),
        **{k: c[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim")}}
    if fraction != 1:
        info["rope_fraction"] = float(fraction)
    if c["attention_bias"]:
        info["attn_bias"] = True
    if hd != c["hidden_size"] // c["num_attention_heads"]:
        info["head_dim"] = hd
    return {**info, **_moe_info(c, name)} if moe else info


def _moe_info(c: dict[str, Any], name: str) -> dict[str, Any]:
    """The moe_* fields: qwen3's router (softmax, top-k, renormalised: always in Qwen3.5-MoE, norm_topk_prob in
    Qwen3-Next), one shared expert behind its sigmoid gate, MoE on the layers (i + 1) % decoder_sparse_step == 0."""
    step = c["decoder_sparse_step"] if c["model_type"] == NEXT else 1
    experts, top_k = c.get("num_experts"), c.get("num_experts_per_tok")
    widths = {k: c.get(k) for k in ("moe_intermediate_size", "shared_expert_intermediate_size")}
    wrong = [f"{k}={v!r} must be a positive integer" for k, v in
             (("num_experts", experts), ("num_experts_per_tok", top_k), *widths.items()) if not _int(v)]
    if not wrong and isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        wrong.append(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    coef = c["router_aux_loss_coef"]
    if not (isinstance(coef, (int, float)) and not isinstance(coef, bool) and 0 <= coef < float("inf")):
        wrong.append(f"router_aux_loss_coef={coef!r} must be a number >= 0")
    if wrong:
        raise CheckpointError(f"this {name} config cannot be imported: {'; '.join(wrong)}")
    return {**hf_moe.MOE_DEFAULTS, "moe_experts": experts, "moe_top_k": top_k,
            "moe_ffn_hidden_size": widths["moe_intermediate_size"], "moe_shared_experts": 1,
            "moe_shared_ffn_hidden_size": widths["shared_expert_intermediate_size"], "moe_shared_gate": True,
            "moe_first_dense": step - 1, "moe_every": step, "moe_router": "qwen3",
            "moe_renorm": bool(c["norm_topk_prob"]) if c["model_type"] == NEXT else True,
            "moe_aux_loss": float(coef) if c.get("output_router_logits") else 0.0}


def claims(info: dict[str, Any]) -> bool:
    """A megalite model this module writes: linear_attention layers, a gated shared expert, or the per-element
    output gate with q/k norm (the full-attention layers of these families)."""
    return (LINEAR in (info.get("layer_types") or []) or bool(info.get("moe_shared_gate"))
            or (info.get("attn_output_gate") == "element" and bool(info.get("qk_norm"))))


NEEDS: list[Need] = [  # what these families compute, field by field of megalite's model info
    ("arch", "arch=llama", lambda v: v == "llama"), ("qk_norm", "q/k norm (model.qk_norm)", bool),
    ("attn_output_gate", "the per-element output gate (model.attn_output_gate=element)", lambda v: v == "element"),
    ("mlp", "SwiGLU (model.mlp=swiglu)", lambda v: v == "swiglu"), ("mlp_bias", "no MLP bias", off),
    ("layer_types", "only linear_attention and full_attention layers",
     lambda v: set(v or []) <= {LINEAR, FULL}), ("attn_sinks", "no attention sinks", off),
    ("sandwich_norm", "no post-norms", off), ("embed_scale", "no embedding scale", off),
    ("attn_softcap", "no attention soft-cap", off), ("final_softcap", "no final soft-cap", off),
    ("query_pre_attn_scalar", "the softmax scale 1/sqrt(head_dim)", off), ("nope_layers", "no NoPE layer", off),
    ("rope_scaling", "plain RoPE (no model.rope_scaling)", off), ("mla", "grouped-query attention (no [mla])", off),
    ("mtp_layers", "no multi-token prediction module", off)]
MOE_NEEDS: list[Need] = [
    ("moe_router", "the qwen3 router (softmax, top-k)", lambda v: v == "qwen3"),
    ("moe_shared_experts", "shared experts (moe.shared_experts)", bool),
    ("moe_shared_gate", "the shared experts' sigmoid gate (moe.shared_gate)", bool),
    ("moe_capacity_factor", "no capacity factor (dropless)", off), ("moe_router_bias", "no router bias", off),
    ("moe_groups", "no group-limited routing", lambda v: v in (None, 1)),
    ("moe_route_scale", "routing weights unscaled", lambda v: v in (None, 1.0))]


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for a megalite Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (see the module's docstring for which)."""
    s = hf_moe.settings(info)
    problems = unmet(info, NEEDS + (MOE_NEEDS if s is not None else []))
    if s is not None and s.first_dense != s.every - 1:
        problems.append(f"MoE layers from {s.first_dense} every {s.every} (Qwen3-Next's are those with (i + 1) % "
                        "decoder_sparse_step == 0)")
    if problems:
        raise CheckpointError(f"this model has no {ARCHS['qwen3_5_text']} / Qwen3.5-MoE / Qwen3-Next equivalent: it "
                              f"needs {'; '.join(problems)}")
    kind, hd, d = _kind(info), head_dim(info), _linear_dims(info)
    out = {"architectures": [ARCHS[kind]], "model_type": kind, "vocab_size": info["vocab_size"],
           "hidden_size": info["hidden_size"], "num_hidden_layers": info["num_layers"],
           "num_attention_heads": info["num_heads"], "num_key_value_heads": info["num_kv_heads"], "head_dim": hd,
           "hidden_act": "silu", "max_position_embeddings": info["seq_len"], "rms_norm_eps": info["norm_eps"],
           "tie_word_embeddings": bool(info["tie_embeddings"]), "attention_bias": bool(info.get("attn_bias")),
           "attention_dropout": 0.0, "layer_types": layer_types(info),
           "rope_parameters": {"rope_type": "default", "rope_theta": info["rope_theta"],
                               "partial_rotary_factor": info.get("rope_fraction", 1.0)},
           "linear_num_key_heads": d.key_heads, "linear_num_value_heads": d.value_heads,
           "linear_key_head_dim": d.key_head_dim, "linear_value_head_dim": d.value_head_dim,
           "linear_conv_kernel_dim": d.conv_kernel,
           # No padding row: transformers' embedding would give token 0 no gradient, megalite's gives every row one.
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if kind != MOE:
        out["intermediate_size"] = info["ffn_hidden_size"]
    if s is not None:
        out |= {"num_experts": s.experts, "num_experts_per_tok": s.top_k, "moe_intermediate_size": s.ffn_hidden_size,
                "shared_expert_intermediate_size": s.shared_experts * s.shared_ffn_hidden_size,
                "router_aux_loss_coef": s.aux_loss, "output_router_logits": s.aux_loss > 0}
        if kind == NEXT:
            out |= {"decoder_sparse_step": s.every, "norm_topk_prob": s.renorm, "mlp_only_layers": []}
    return out


LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")


def _linear_dims(info: dict[str, Any]) -> LinearDims:
    """The linear layers' shape, the model.linear_* fields resolved as the model resolves them (0 = derived)."""
    m = SimpleNamespace(num_heads=info["num_heads"], **{k: info.get(k, VARIANT_DEFAULTS[k]) for k in LINEAR_KEYS})
    return linear_dims(m, head_dim(info))


def _kind(info: dict[str, Any]) -> str:
    """The model_type a megalite model exports as (the module's docstring says which)."""
    s = hf_moe.settings(info)
    return "qwen3_5_text" if s is None else MOE if s.every == 1 and s.renorm else NEXT


# ---------------------------------------------------------------------------------------- tensor names
def rules(info: dict[str, Any]) -> list[hf.Rule]:
    head, tail = ends(info)
    out, hd, s, d = head, head_dim(info), hf_moe.settings(info), _linear_dims(info)
    kd, vd, nv = d.key_dim, d.value_dim, d.value_heads
    next_ = _kind(info) == NEXT
    for i, kind in enumerate(layer_types(info)):
        ours, p = f"layers.{i}.", f"model.layers.{i}."
        out.append((ours + "norm1.weight", [p + "input_layernorm.weight"], None, False))
        if kind == LINEAR:
            a, t = ours + "attn.gdn.", p + "linear_attn."
            proj = ([t + "in_proj_qkvz.weight", t + "in_proj_ba.weight"], [2 * kd + 2 * vd, 2 * nv]) if next_ else \
                ([t + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")], [2 * kd + vd, vd, nv, nv])
            out += [(a + "in_proj.weight", proj[0], proj[1], False),
                    *((a + x, [t + y], None, False) for x, y in (
                        ("conv_weight", "conv1d.weight"), ("A_log", "A_log"), ("dt_bias", "dt_bias"),
                        ("norm_weight", "norm.weight"), ("out_proj.weight", "out_proj.weight")))]
        else:
            q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
            for w in ["weight", "bias"] if info.get("attn_bias") else ["weight"]:
                names = [f"{p}self_attn.{x}_proj.{w}" for x in "qkvq"]  # q_proj twice: the query, then the gate
                out += [(f"{ours}attn.qkv.{w}", names, [q, kv, kv, q], False),
                        (f"{ours}attn.out.{w}", [f"{p}self_attn.o_proj.{w}"], None, False)]
            out += [(f"{ours}attn.{x}_norm.weight", [f"{p}self_attn.{x}_norm.weight"], None, False) for x in "qk"]
        out.append((ours + "norm2.weight", [p + "post_attention_layernorm.weight"], None, False))
        if s is None or not s.is_moe_layer(i):
            f = info["ffn_hidden_size"]
            out += [(ours + "mlp.up.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [f, f], False),
                    (ours + "mlp.down.weight", [p + "mlp.down_proj.weight"], None, False)]
            continue
        sf, m = s.shared_experts * s.shared_ffn_hidden_size, p + "mlp."
        out += [(ours + "mlp.router.weight", [m + "gate.weight"], None, False),
                (ours + "mlp.experts.up", [m + "experts.gate_up_proj"], None, False),
                (ours + "mlp.experts.down", [m + "experts.down_proj"], None, False),
                (ours + "mlp.shared.up.weight", [m + "shared_expert.gate_proj.weight",
                                                 m + "shared_expert.up_proj.weight"], [sf, sf], False),
                (ours + "mlp.shared.down.weight", [m + "shared_expert.down_proj.weight"], None, False),
                (ours + "mlp.shared_gate.weight", [m + "shared_expert_gate.weight"], None, False)]
    return out + tail


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, s = info["hidden_size"], _linear_dims(info), hf_moe.settings(info)
    kd, vd, nv = d.key_dim, d.value_dim, d.value_heads
    gq = info["num_heads"] * head_dim(info)  # the output gate's rows in the fused qkv
    sf = 0 if s is None else s.shared_experts * s.shared_ffn_hidden_size
    own = {"attn.gdn.in_proj.weight": (2 * kd + 2 * vd + 2 * nv, h),
           "attn.gdn.conv_weight": (2 * kd + vd, d.conv_kernel), "attn.gdn.A_log": (nv,),
           "attn.gdn.dt_bias": (nv,), "attn.gdn.norm_weight": (d.value_head_dim,),
           "attn.gdn.out_proj.weight": (h, vd), "mlp.shared.up.weight": (2 * sf, h),
           "mlp.shared.down.weight": (h, sf), "mlp.shared_gate.weight": (1, h)}
    table = rules(info)
    out = shapes(info, [r for r in table if r[0].split(".", 2)[-1] not in own])
    for name, *_ in table:
        rest = name.split(".", 2)[-1]
        if rest in own:
            out[name] = own[rest]
        elif rest in ("attn.qkv.weight", "attn.qkv.bias"):
            out[name] = (out[name][0] + gq,) + out[name][1:]
    return out


# ---------------------------------------------------------------------------------------- tensor values
def _zero_centred(name: str) -> bool:
    """transformers' (1 + w) norms: the layer norms, q/k norms and the final norm (not the GDN's gated norm)."""
    return name.endswith(("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")) or \
        name == "model.norm.weight"


def _q_rows(info: dict[str, Any], to_hf: bool) -> torch.Tensor:
    """The row order taking q_proj between megalite's [q; gate] and transformers' per-head [q_h; gate_h]."""
    nh, hd = info["num_heads"], head_dim(info)
    theirs = torch.arange(2 * nh * hd).view(nh, 2, hd)  # transformers' row of (head, query|gate, dim)
    ours = theirs.transpose(0, 1).reshape(-1)           # megalite's row i holds transformers' row ours[i]
    return torch.argsort(ours) if to_hf else ours


def _grouped_rows(info: dict[str, Any], qkvz: bool, to_hf: bool) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz (in_proj_ba) row order, grouped per key head, against megalite's by part."""
    d = _linear_dims(info)
    r = d.value_heads // d.key_heads
    per = [d.key_head_dim, d.key_head_dim, r * d.value_head_dim, r * d.value_head_dim] if qkvz else [r, r]
    theirs = torch.arange(d.key_heads * sum(per)).view(d.key_heads, sum(per))
    ours = torch.cat([part.reshape(-1) for part in theirs.split(per, dim=1)])
    return torch.argsort(ours) if to_hf else ours


def _next_part(name: str, info: dict[str, Any]) -> tuple[str, int, int] | None:
    """For Qwen3.5's in_proj_{qkv,z,b,a} of a Qwen3-Next file: (its stored tensor, first row, end row) of that
    tensor regrouped by part (the import reads a Qwen3-Next it exports as Qwen3.5-MoE by Qwen3.5's names)."""
    p, _, part = name.rpartition(".in_proj_")
    d = _linear_dims(info)
    kd, vd, nv = d.key_dim, d.value_dim, d.value_heads
    bounds = {"qkv.weight": ("qkvz", 0, 2 * kd + vd), "z.weight": ("qkvz", 2 * kd + vd, 2 * kd + 2 * vd),
              "b.weight": ("ba", 0, nv), "a.weight": ("ba", nv, 2 * nv)}
    if not p.endswith("linear_attn") or part not in bounds:
        return None
    stored, start, end = bounds[part]
    return f"{p}.in_proj_{stored}.weight", start, end


def _rows(name: str, info: dict[str, Any], to_hf: bool) -> torch.Tensor | None:
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return _q_rows(info, to_hf)
    if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
        return _grouped_rows(info, "qkvz" in name, to_hf)
    return None


def export_tensor(name: str, t: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """transformers' value of a tensor: a norm's w - 1, q_proj interleaved per head, Qwen3-Next's in_proj grouped
    per key head, the conv [C, 1, W]."""
    rows = _rows(name, info, to_hf=True)
    if rows is not None:
        return t[rows].contiguous()
    if name.endswith("conv1d.weight"):
        return t.unsqueeze(1)
    return t - 1.0 if _zero_centred(name) else t


def export_shape(name: str, shape: tuple[int, ...], info: dict[str, Any]) -> tuple[int, ...]:
    return (shape[0], 1) + shape[1:] if name.endswith("conv1d.weight") else shape


def source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    """transformers' tensors by their in-memory names in megalite's values: norms 1 + w, q_proj [q; gate], Qwen3-Next's
    in_proj by part, the conv [C, W]; a composite's `model.language_model.*` read as `model.*`; per-expert hub
    tensors stacked (hf_moe.hub_experts)."""
    raw_get, raw_shape = src
    text = _text(cfg)

    def stored(name: str) -> str:
        return _LANGUAGE + name.removeprefix("model.") if cfg.get("model_type") in COMPOSITE else name

    get, shape = hf_moe.hub_experts(((lambda n: raw_get(stored(n))), (lambda n: raw_shape(stored(n)))), info)
    if text.get("mtp_num_hidden_layers"):
        print(f"note: the multi-token prediction module (mtp.*, {text['mtp_num_hidden_layers']} layer(s)) is not "
              f"imported: transformers' {ARCHS[text['model_type']]} drops it too", file=sys.stderr)
    next_ = text["model_type"] == NEXT

    def tensor(name: str) -> torch.Tensor:
        part = _next_part(name, info) if next_ else None
        if part is not None:
            whole, start, end = part
            return tensor(whole)[start:end]
        t = get(name)
        rows = _rows(name, info, to_hf=False)
        if rows is not None:
            return t[rows]
        if name.endswith("conv1d.weight"):
            return t.squeeze(1)
        return t + 1.0 if _zero_centred(name) else t

    def shape_of(name: str) -> list[int]:
        part = _next_part(name, info) if next_ else None
        if part is not None:
            whole, start, end = part
            return [end - start] + shape(whole)[1:]
        got = shape(name)
        return [got[0]] + got[2:] if name.endswith("conv1d.weight") and len(got) == 3 else got

    return tensor, shape_of


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, source, export_tensor, export_shape)
