"""Hugging Face GptOssForCausalLM both ways: sliding and full layers, attention sinks, q/k/v/o biases, YaRN, the
MoE on every layer with its router bias, the clamped SwiGLU experts and their biases; the hub's MXFP4 experts
dequantised on import.

Names (megalite's global names on the left, transformers' on the right; p = `model.layers.i.`):

  layers.i.norm1 / norm2.weight       p input_layernorm / post_attention_layernorm.weight
  layers.i.attn.qkv.{weight,bias}     p self_attn.{q,k,v}_proj.{weight,bias}           rows [q; k; v]
  layers.i.attn.out.{weight,bias}     p self_attn.o_proj.{weight,bias}
  layers.i.attn.sinks                 p self_attn.sinks                                 [heads]
  layers.i.mlp.router.weight / logit_bias   p mlp.router.weight / bias                  [E, h] / [E]
  layers.i.mlp.experts.up             p mlp.experts.gate_up_proj      [E, 2F, h]  <-  [E, h, 2F], columns interleaved
  layers.i.mlp.experts.up_bias        p mlp.experts.gate_up_proj_bias [E, 2F]     <-  [E, 2F], interleaved
  layers.i.mlp.experts.down           p mlp.experts.down_proj         [E, h, F]   <-  [E, F, h]
  layers.i.mlp.experts.down_bias      p mlp.experts.down_proj_bias    [E, h]
  embedding / final_norm / head       model.embed_tokens / model.norm / lm_head

transformers keeps each layer's experts as x @ W ([E, in, out]: transposed against megalite's [E, out, in]) and
its gate_up_proj's 2F columns interleaved, gate in the even ones and up in the odd (`GptOssExperts._apply_gate`
reads gate_up[..., ::2] and [..., 1::2]); megalite's fused up has the F gate rows first, then the F up rows. The
import de-interleaves and transposes; the export interleaves back. transformers' router takes the softmax over the
top-k of the biased logits: megalite's `mixtral` router with `moe.router_bias`.

MXFP4 (the hub's release, config.json's quantization_config quant_method "mxfp4"): each expert weight is stored as
`<name>_blocks` (uint8 [E, rows, G, 16]: 32 FP4 e2m1 codes per group, two a byte, the low nibble first) and
`<name>_scales` (uint8 [E, rows, G]: the group's power of two, biased by 127), rows the output dim, G x 32 the input
dim; `dequantize_mxfp4` gives value = FP4[code] x 2^(scale - 127) as transformers' integrations/mxfp4.py does, in
fp32 (exact: an FP4 value times a power of two), then the layout above. The export writes bf16 or fp32, unquantised.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpoint.interop import hf, hf_moe
from megalite.checkpoint.interop.hf_pattern import (SLIDING, FULL, Need, attention_rules, ends, head_dim,
                                                    layer_types, off, read_layer_types, shapes, unmet)
from megalite.checkpoint.interop.hf_rope import hf_rope_parameters, rope_scaling_info
from megalite.errors import CheckpointError

ARCH = "GptOssForCausalLM"
# transformers' GptOssConfig defaults, for keys a config.json leaves out (its rope_parameters default: YaRN 32x).
DEFAULTS: dict[str, Any] = {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702,
                            "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
                            "num_experts_per_tok": 4, "max_position_embeddings": 131072, "rope_theta": 150000.0,
                            "router_aux_loss_coef": 0.001}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes
_QUANTISED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# ----------------------------------------------------------------------------------------- config.json
def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model info for a gpt_oss config.json."""
    c = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}}
    layers, experts, top_k = c["num_hidden_layers"], c["num_local_experts"], c["num_experts_per_tok"]
    wrong = [f"{k}={v!r} must be a positive integer" for k, v in
             (("num_local_experts", experts), ("num_experts_per_tok", top_k), ("head_dim", c["head_dim"]))
             if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
    wrong += [f"{k}={c[k]!r} must be a positive number" for k in ("swiglu_alpha", "swiglu_limit")
              if not (isinstance(c[k], (int, float)) and not isinstance(c[k], bool) and c[k] > 0)]
    if not wrong and top_k > experts:
        wrong.append(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    quant = cfg.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"):
        wrong.append(f"quantization_config {quant!r} is not the hub's MXFP4 (quant_method mxfp4)")
    if wrong:
        raise CheckpointError(f"this {ARCH} config cannot be imported: {'; '.join(wrong)}")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {**DEFAULT_ROPE, "rope_theta": c["rope_theta"]}
    if not isinstance(rope, dict):
        raise CheckpointError(f"this {ARCH} config cannot be imported: rope_parameters={rope!r} is not an object")
    coef = c["router_aux_loss_coef"]
    if not (isinstance(coef, (int, float)) and not isinstance(coef, bool) and 0 <= coef < float("inf")):
        raise CheckpointError(f"this {ARCH} config cannot be imported: router_aux_loss_coef={coef!r} must be >= 0")
    alternating = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]  # transformers' default
    info: dict[str, Any] = {
        "arch": "llama", "num_layers": layers, "hidden_size": c["hidden_size"],
        "num_heads": c["num_attention_heads"], "num_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"], "seq_len": c["max_position_embeddings"],
        "make_vocab_divisible_by": 64, "tie_embeddings": bool(c["tie_word_embeddings"]), "norm_eps": c["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", c["rope_theta"]), **rope_scaling_info(rope, c, "rope_parameters"),
        **read_layer_types(c, layers, alternating, ARCH),
        "attn_sinks": True, "attn_bias": bool(c["attention_bias"]), "mlp": "clamped_swiglu",
        "swiglu_alpha": float(c["swiglu_alpha"]), "swiglu_limit": float(c["swiglu_limit"]), "mlp_bias": True,
        **hf_moe.MOE_DEFAULTS, "moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": c["intermediate_size"],
        "moe_first_dense": 0, "moe_every": 1, "moe_router": "mixtral", "moe_renorm": True, "moe_router_bias": True,
        "moe_aux_loss": float(coef) if c.get("output_router_logits") else 0.0}
    if c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]:
        info["head_dim"] = c["head_dim"]
    return info


def claims(info: dict[str, Any]) -> bool:
    """A megalite model this module writes: attention sinks (transformers' GptOss always has them)."""
    return bool(info.get("attn_sinks"))


NEEDS: list[Need] = [  # what GptOssForCausalLM computes, field by field of megalite's model info
    ("arch", "arch=llama", lambda v: v == "llama"), ("attn_sinks", "attention sinks", bool),
    ("mlp", "the clamped SwiGLU (model.mlp=clamped_swiglu)", lambda v: v == "clamped_swiglu"),
    ("mlp_bias", "expert biases (model.mlp_bias)", bool), ("moe_router_bias", "a router bias (moe.router_bias)", bool),
    ("moe_experts", "a MoE on every layer", bool), ("moe_first_dense", "no dense layer (moe.first_dense=0)", off),
    ("moe_every", "a MoE on every layer (moe.every=1)", lambda v: v == 1),
    ("moe_router", "the mixtral router (softmax over the top-k logits)", lambda v: v == "mixtral"),
    ("moe_shared_experts", "no shared experts", off), ("moe_capacity_factor", "no capacity factor (dropless)", off),
    ("qk_norm", "no q/k norm", off), ("sandwich_norm", "no post-norms", off), ("embed_scale", "no embedding scale", off),
    ("attn_softcap", "no attention soft-cap", off), ("final_softcap", "no final soft-cap", off),
    ("rope_fraction", "RoPE on every dim", lambda v: v in (None, 1.0)), ("nope_layers", "no NoPE layer", off),
    ("attn_output_gate", "no output gate", off), ("rope_local_theta", "one RoPE base for every layer", off)]


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for a megalite gpt-oss (every field transformers reads written out, no MXFP4)."""
    problems = unmet(info, NEEDS)
    qpas = info.get("query_pre_attn_scalar")
    if qpas and qpas != head_dim(info):
        problems.append(f"the softmax scale 1/sqrt(head_dim) (has query_pre_attn_scalar={qpas!r})")
    if problems:
        raise CheckpointError(f"this model has no {ARCH} equivalent: it needs {'; '.join(problems)}")
    s = hf_moe.settings(info)
    assert s is not None
    types = layer_types(info)
    return {"architectures": [ARCH], "model_type": "gpt_oss", "vocab_size": info["vocab_size"],
            "hidden_size": info["hidden_size"], "intermediate_size": s.ffn_hidden_size,
            "num_hidden_layers": info["num_layers"], "num_attention_heads": info["num_heads"],
            "num_key_value_heads": info["num_kv_heads"], "head_dim": head_dim(info), "num_local_experts": s.experts,
            "num_experts_per_tok": s.top_k, "layer_types": types,
            "sliding_window": info.get("sliding_window") if SLIDING in types else None,
            "rms_norm_eps": info["norm_eps"], "max_position_embeddings": info["seq_len"],
            "rope_parameters": {"rope_theta": info["rope_theta"], **hf_rope_parameters(info)},
            "swiglu_alpha": info.get("swiglu_alpha", 1.702), "swiglu_limit": info.get("swiglu_limit", 7.0),
            "attention_bias": bool(info.get("attn_bias")), "router_aux_loss_coef": s.aux_loss,
            "output_router_logits": s.aux_loss > 0, "hidden_act": "silu", "attention_dropout": 0.0,
            "tie_word_embeddings": bool(info["tie_embeddings"]), "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": "float32"}


# ---------------------------------------------------------------------------------------- tensor names
def rules(info: dict[str, Any]) -> list[hf.Rule]:
    head, tail = ends(info)
    out = head
    for i in range(info["num_layers"]):
        ours, p = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(i, info)
        out += [(ours + "norm2.weight", [p + "post_attention_layernorm.weight"], None, False),
                (ours + "mlp.router.weight", [p + "mlp.router.weight"], None, False),
                (ours + "mlp.router.logit_bias", [p + "mlp.router.bias"], None, False),
                (ours + "mlp.experts.up", [p + "mlp.experts.gate_up_proj"], None, True),
                (ours + "mlp.experts.up_bias", [p + "mlp.experts.gate_up_proj_bias"], None, False),
                (ours + "mlp.experts.down", [p + "mlp.experts.down_proj"], None, True),
                (ours + "mlp.experts.down_bias", [p + "mlp.experts.down_proj_bias"], None, False)]
    return out + tail


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return shapes(info, rules(info))


# ---------------------------------------------------------------------------------------- tensor values
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks (uint8 [..., G, 16]) and scales (uint8 [..., G]) -> fp32 [..., G x 32]: FP4_VALUES[code] x
    2^(scale - 127), the low nibble of each byte first (transformers' `convert_moe_packed_tensors`, before its
    transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], 32)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).reshape(*blocks.shape[:-2], -1)


def _interleaved(name: str) -> bool:
    return name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"))


def _deinterleave(n: int) -> torch.Tensor:
    """[0, 2, 4, ..., 1, 3, 5, ...]: the gate columns, then the up columns, of n interleaved ones."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def export_tensor(name: str, t: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """A tensor in transformers' layout (already transposed): gate_up_proj's columns [gate; up] interleaved."""
    if not _interleaved(name):
        return t
    return t[..., torch.argsort(_deinterleave(t.shape[-1]))].contiguous()


def source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    """transformers' tensors by their in-memory names, in its layout but gate_up_proj's columns de-interleaved
    ([gate; up]); an expert weight stored as MXFP4 `_blocks` / `_scales` is dequantised (fp32)."""
    get, shape = src

    def packed(name: str) -> bool:
        """`name` is stored as MXFP4 blocks and scales, not as itself."""
        if not name.endswith(_QUANTISED):
            return False
        try:
            shape(name)
            return False
        except CheckpointError:
            shape(name + "_blocks")  # neither: "has no tensor <name>_blocks"
            if cfg.get("quantization_config") is None:
                raise CheckpointError(f"{name} is stored as MXFP4 blocks but config.json has no quantization_config: "
                                      "not the hub's gpt-oss release") from None
            return True

    def shape_of(name: str) -> list[int]:
        if not packed(name):
            return shape(name)
        e, rows, groups, width = shape(name + "_blocks")
        if width != 16 or shape(name + "_scales") != [e, rows, groups]:
            raise CheckpointError(f"{name}_blocks {[e, rows, groups, width]} and _scales {shape(name + '_scales')} "
                                  "are not MXFP4 (blocks [E, rows, G, 16], scales [E, rows, G])")
        return [e, groups * 32, rows]  # transformers' [E, in, out]

    def tensor(name: str) -> torch.Tensor:
        if packed(name):
            shape_of(name)  # checked
            blocks, scales = get(name + "_blocks"), get(name + "_scales")
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
                raise CheckpointError(f"{name}_blocks / _scales are {blocks.dtype} / {scales.dtype}, not uint8 MXFP4")
            t = torch.stack([dequantize_mxfp4(blocks[e], scales[e]).t() for e in range(blocks.shape[0])])
        else:
            t = get(name)
        return t[..., _deinterleave(t.shape[-1])] if _interleaved(name) else t

    return tensor, shape_of


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, source, export_tensor)
