"""Hugging Face Gemma3ForCausalLM (model_type gemma3_text, the text-only model) both ways: local (sliding) and global
layers with their own RoPE bases, q/k norms, pre- and post-norms around attention and MLP, GeGLU, embeddings
times sqrt(hidden), `query_pre_attn_scalar`, and the final-logit soft-cap where set.

Names (megalite's global names on the left, transformers' on the right; p = `model.layers.i.`):

  layers.i.norm1.weight           p input_layernorm.weight             (1 + w)
  layers.i.attn.qkv.weight        p self_attn.{q,k,v}_proj.weight      rows [q; k; v]  (and .bias with attention_bias)
  layers.i.attn.out.weight        p self_attn.o_proj.weight
  layers.i.attn.{q,k}_norm.weight p self_attn.{q,k}_norm.weight        (1 + w)  [head_dim]
  layers.i.post_attn_norm.weight  p post_attention_layernorm.weight    (1 + w)  the norm AFTER attention (Gemma's
                                                                                sandwich; Llama's name for norm2)
  layers.i.norm2.weight           p pre_feedforward_layernorm.weight   (1 + w)
  layers.i.post_mlp_norm.weight   p post_feedforward_layernorm.weight  (1 + w)
  layers.i.mlp.up.weight          p mlp.{gate,up}_proj.weight          rows [gate; up]
  layers.i.mlp.down.weight        p mlp.down_proj.weight
  embedding / final_norm / head   model.embed_tokens / model.norm (1 + w) / lm_head (absent when tied, the default)

Gemma's RMSNorm multiplies by (1 + w) (its weights start at 0), megalite's by w: the import stores 1 + w_hf, the
export w - 1, each in fp32 (transformers too computes 1.0 + w in fp32: the same factor). An import exported
again gives w back up to one fp32 rounding of 1 + w (|w| << 1: an ulp of 1, 1.2e-7).

Config: `layer_types` (or the older sliding_window_pattern, 6) -> model.layer_types as a period; the global layers'
RoPE (`rope_parameters.full_attention`, or rope_theta + rope_scaling) -> model.rope_theta and its scaling, the
local layers' (`.sliding_attention`, or rope_local_base_freq) -> model.rope_local_theta; megalite scales every
layer's RoPE alike, so a scaling on the global layers only (Gemma 3 4B+'s linear x8) is refused with the local
layers present. `attn_logit_softcapping` is Gemma 2's: transformers' Gemma 3 reads it but never applies it (its
attention takes no soft-cap), so the import leaves it out, as transformers computes, and the export refuses a
megalite model.attn_softcap (Gemma 3 cannot express it). transformers' embedding scale is sqrt(hidden) rounded to the weights' dtype: exact in fp32 (what
these tests run); megalite multiplies by the fp32 sqrt(hidden) in every dtype (in bf16 transformers' factor is
the bf16 rounding of it, e.g. 34.0 for Gemma 3 1B's sqrt(1152) = 33.94).
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpoint.interop import hf
from megalite.checkpoint.interop.hf_pattern import (SLIDING, FULL, Need, attention_rules, ends, head_dim,
                                                    layer_types, off, read_layer_types, shapes, unmet)
from megalite.checkpoint.interop.hf_rope import hf_rope_parameters, rope_scaling_info
from megalite.errors import CheckpointError

ARCH = "Gemma3ForCausalLM"
# transformers' Gemma3TextConfig defaults, for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                            "max_position_embeddings": 131072, "tie_word_embeddings": True, "attention_bias": False,
                            "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                            "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}


# ----------------------------------------------------------------------------------------- config.json
def _ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' rope parameters, local layers'), each with its rope_theta, from either config format."""
    given = cfg.get("rope_parameters")
    if isinstance(given, dict) and (FULL in given or SLIDING in given):
        full, local = given.get(FULL) or {}, given.get(SLIDING) or {}
    else:  # the older format: rope_theta and rope_scaling for the global layers, rope_local_base_freq
        full, local = cfg.get("rope_scaling") or given or {}, {}
    if not (isinstance(full, dict) and isinstance(local, dict)):
        raise CheckpointError(f"this {ARCH} config cannot be imported: rope_parameters={given!r} is not an object of "
                              "objects")
    return ({**full, "rope_theta": full.get("rope_theta", cfg["rope_theta"])},
            {**local, "rope_theta": local.get("rope_theta", cfg["rope_local_base_freq"])})


def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model info for a gemma3_text config.json."""
    c = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}}
    layers, pattern = c["num_hidden_layers"], c["sliding_window_pattern"]
    bad = [what for what, ok in (
        ("hidden_activation must be gelu_pytorch_tanh (GeGLU with the tanh GeLU)",
         c["hidden_activation"] == "gelu_pytorch_tanh"),
        ("use_bidirectional_attention must be false (megalite's attention is causal)",
         not c.get("use_bidirectional_attention")),
        (f"query_pre_attn_scalar={c['query_pre_attn_scalar']!r} must be a positive number",
         isinstance(c["query_pre_attn_scalar"], (int, float)) and not isinstance(c["query_pre_attn_scalar"], bool)
         and c["query_pre_attn_scalar"] > 0),
        (f"head_dim={c['head_dim']!r} must be a positive integer", isinstance(c["head_dim"], int) and c["head_dim"] > 0),
        (f"sliding_window_pattern={pattern!r} must be a positive integer", isinstance(pattern, int) and pattern > 0),
        *((f"{k}={c.get(k)!r} must be a positive number or null", c.get(k) is None or (
            isinstance(c[k], (int, float)) and not isinstance(c[k], bool) and c[k] > 0))
          for k in ("attn_logit_softcapping", "final_logit_softcapping"))) if not ok]
    if bad:
        raise CheckpointError(f"this {ARCH} config cannot be imported: {'; '.join(bad)}")
    default_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]  # transformers' default
    pattern_info = read_layer_types(c, layers, default_types, ARCH)
    types = layer_types({"num_layers": layers, **pattern_info})
    full, local = _ropes(c)
    full_scaling = rope_scaling_info(full, c, "rope_parameters.full_attention")
    local_scaling = rope_scaling_info(local, c, "rope_parameters.sliding_attention")
    if FULL in types and SLIDING in types and full_scaling != local_scaling:
        raise CheckpointError(f"this {ARCH} config cannot be imported: its global and local layers scale RoPE "
                              f"differently ({full_scaling or 'none'} vs {local_scaling or 'none'}); megalite scales "
                              "every layer's RoPE alike")
    rope = ({"rope_theta": full["rope_theta"], **full_scaling} if FULL in types else
            {"rope_theta": local["rope_theta"], **local_scaling})
    if FULL in types and SLIDING in types:
        rope["rope_local_theta"] = local["rope_theta"]
    info: dict[str, Any] = {
        "arch": "llama", "num_layers": layers, "hidden_size": c["hidden_size"],
        "num_heads": c["num_attention_heads"], "num_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"], "seq_len": c["max_position_embeddings"],
        "make_vocab_divisible_by": 64, "tie_embeddings": bool(c["tie_word_embeddings"]), "norm_eps": c["rms_norm_eps"],
        **rope, **pattern_info, "qk_norm": True, "sandwich_norm": True, "embed_scale": True, "mlp": "geglu",
        "query_pre_attn_scalar": float(c["query_pre_attn_scalar"])}
    if c["attention_bias"]:
        info["attn_bias"] = True
    if c.get("final_logit_softcapping"):  # attn_logit_softcapping: transformers' Gemma 3 never applies it
        info["final_softcap"] = float(c["final_logit_softcapping"])
    if c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]:
        info["head_dim"] = c["head_dim"]
    return info


def claims(info: dict[str, Any]) -> bool:
    """A megalite model this module writes: Gemma's post-norms or embedding scale (no other family has them)."""
    return bool(info.get("sandwich_norm") or info.get("embed_scale"))


NEEDS: list[Need] = [  # what Gemma3ForCausalLM computes, field by field of megalite's model info
    ("arch", "arch=llama", lambda v: v == "llama"), ("sandwich_norm", "post-norms (model.sandwich_norm)", bool),
    ("embed_scale", "the embedding scale (model.embed_scale)", bool), ("qk_norm", "q/k norm (model.qk_norm)", bool),
    ("mlp", "GeGLU (model.mlp=geglu)", lambda v: v == "geglu"), ("mlp_bias", "no MLP bias", off),
    ("moe_experts", "a dense MLP (no [moe])", off), ("attn_sinks", "no attention sinks", off),
    ("attn_output_gate", "no output gate", off), ("attn_softcap", "no attention soft-cap (Gemma 2's)", off), ("rope_fraction", "RoPE on every dim", lambda v: v in (None, 1.0)),
    ("nope_layers", "no NoPE layer", off)]


def _scalar(value: float) -> float | int:
    """query_pre_attn_scalar as transformers' config takes it: an integer (its type) when it is one."""
    return int(value) if float(value).is_integer() else value


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for a megalite Gemma 3 (text)."""
    problems = unmet(info, NEEDS)
    types = layer_types(info)
    if info.get("rope_scaling", "none") != "none" and SLIDING in types and FULL in types:
        problems.append(f"RoPE scaling on the global layers only (megalite scales every layer's; has "
                        f"rope_scaling={info['rope_scaling']!r} with local layers)")
    if problems:
        raise CheckpointError(f"this model has no {ARCH} equivalent: it needs {'; '.join(problems)}")
    theta = info["rope_theta"]
    local = {"rope_theta": info.get("rope_local_theta") or theta, "rope_type": "default"}
    return {"architectures": [ARCH], "model_type": "gemma3_text", "vocab_size": info["vocab_size"],
            "hidden_size": info["hidden_size"], "intermediate_size": info["ffn_hidden_size"],
            "num_hidden_layers": info["num_layers"], "num_attention_heads": info["num_heads"],
            "num_key_value_heads": info["num_kv_heads"], "head_dim": head_dim(info),
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": info["seq_len"],
            "rms_norm_eps": info["norm_eps"], "tie_word_embeddings": bool(info["tie_embeddings"]),
            "attention_bias": bool(info.get("attn_bias")), "attention_dropout": 0.0,
            "query_pre_attn_scalar": _scalar(info.get("query_pre_attn_scalar") or head_dim(info)),
            "layer_types": types, "sliding_window": info.get("sliding_window") or info["seq_len"],
            "attn_logit_softcapping": None,
            "final_logit_softcapping": info.get("final_softcap") or None, "use_bidirectional_attention": False,
            "rope_parameters": {FULL: {"rope_theta": theta, **hf_rope_parameters(info)},
                                SLIDING: local if SLIDING in types and FULL in types else
                                {"rope_theta": theta, **hf_rope_parameters(info)}},
            # No padding row: transformers' embedding would give token 0 no gradient, megalite's gives every row one.
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


# ---------------------------------------------------------------------------------------- tensor names
def rules(info: dict[str, Any]) -> list[hf.Rule]:
    head, tail = ends(info)
    out, f = head, info["ffn_hidden_size"]
    for i in range(info["num_layers"]):
        ours, p = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(i, info)
        out += [(ours + "post_attn_norm.weight", [p + "post_attention_layernorm.weight"], None, False),
                (ours + "norm2.weight", [p + "pre_feedforward_layernorm.weight"], None, False),
                (ours + "post_mlp_norm.weight", [p + "post_feedforward_layernorm.weight"], None, False),
                (ours + "mlp.up.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [f, f], False),
                (ours + "mlp.down.weight", [p + "mlp.down_proj.weight"], None, False)]
    return out + tail


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return shapes(info, rules(info))


# ---------------------------------------------------------------------------------------- tensor values
def _norm(name: str) -> bool:
    """Every Gemma RMSNorm weight (layer norms, q/k norms, the final norm) ends so: all (1 + w)."""
    return name.endswith("norm.weight")


def export_tensor(name: str, t: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """transformers' value of a tensor: a norm's w - 1."""
    return t - 1.0 if _norm(name) else t


def source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    """transformers' tensors with each norm weight as megalite's 1 + w."""
    get, shape = src
    return (lambda name: get(name) + 1.0 if _norm(name) else get(name)), shape


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, source, export_tensor)
