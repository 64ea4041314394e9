"""Hugging Face DeepseekV3ForCausalLM both ways: MLA, YaRN, the DeepSeek router, shared experts, the dense first
layers, the multi-token prediction layers as the hub stores them, and DeepSeek's block-FP8 release.

`MAPPING` is every architecture together (this one, `hf_moe.MAPPING`'s Mixtral / Qwen3(-MoE) and `hf.DENSE`'s Llama /
GPT-2): what tools/import_hf.py and tools/export_hf.py use. A megalite model with multi-head latent attention
(`info["mla"]`) is a DeepseekV3; anything else is handed to hf_moe.

Names (megalite's global names on the left, hub's on the right; p = `model.layers.i.`):

  layers.i.norm1 / norm2.weight     p input_layernorm / post_attention_layernorm.weight
  layers.i.attn.<x>.weight          p self_attn.<hf_mla.HF_NAMES[x]>.weight   (the RoPE rows permuted, below)
  layers.i.mlp.up / down.weight     p mlp.{gate,up}_proj (rows [gate; up]) / mlp.down_proj      i < first_k_dense
  layers.i.mlp.router.weight        p mlp.gate.weight                                         [E, h]  fp32
  layers.i.mlp.router.bias          p mlp.gate.e_score_correction_bias   a buffer both sides   [E]     fp32
  layers.i.mlp.experts.up / down    p mlp.experts.gate_up_proj [E, 2F, h] / down_proj [E, h, F]  (transformers 5's
                                    fused layout, written; the hub's mlp.experts.{e}.{gate,up,down}_proj.weight
                                    are read too, stacked by hf_moe.hub_experts)
  layers.i.mlp.shared.up / down     p mlp.shared_experts.{gate,up}_proj / down_proj.weight  [S F, h] each / [h, S F]
  mtp.layers.k.enorm / hnorm        q enorm / hnorm.weight                   q = `model.layers.{num_layers + k}.`
  mtp.layers.k.eh_proj              q eh_proj.weight  [h, 2h]: columns [enorm(emb); hnorm(h)], DeepSeek's order
  mtp.layers.k.norm.weight          q shared_head.norm.weight
  mtp.layers.k.block.<as layer i>   q <as layer i>  (layer num_layers + k's MoE-ness: first_k_dense_replace)
  embedding.weight / head.weight    q embed_tokens.weight / q shared_head.head.weight: copies of the shared
                                    embedding and head, written for the hub's layout; the import reads the main
                                    model's (`model.embed_tokens`, `lm_head`), the first rule of a name.

The hub's RoPE rows are interleaved pairs (`rope_interleave`, true on the hub): hf_mla permutes them on the way
in and back on the way out. transformers ignores the MTP layers when it loads (it builds num_hidden_layers decoder
layers; the hub's `model.layers.61.*` is on its ignore list, a tiny model's `model.layers.{L}.*` is reported as
unexpected and skipped), so the MTP layers are checked against the paper (tests/test_hf_deepseek.py).

FP8: DeepSeek's release stores each linear weight as float8_e4m3fn beside a `weight_scale_inv` of 128 x 128 block
dequantisers (config.json's quantization_config); the import dequantises every such weight in fp32 with
`megalite.fp8.checkpoint.dequantize_block_fp8` before anything else (experts stacked after). The export writes no
FP8: megalite trains in fp32/bf16 masters.

MLA's latent RMSNorms: transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever rms_norm_eps
says, megalite with model.norm_eps: the conversion needs rms_norm_eps = 1e-6 (DeepSeek-V3's) both ways.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpoint.interop import hf, hf_moe
from megalite.checkpoint.interop.hf_mla import HF_NAMES, attention_from_hf, attention_to_hf
from megalite.checkpoint.interop.hf_rope import hf_rope_parameters, rope_scaling_info
from megalite.errors import CheckpointError
from megalite.fp8.checkpoint import DEEPSEEK_BLOCK, dequantize_block_fp8, scale_inv_name
from megalite.mla.config import MLAConfig

ARCH = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm
_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
         "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


# ----------------------------------------------------------------------------------------- config.json
def _problems(cfg: dict[str, Any]) -> list[str]:
    """What in this DeepseekV3 config megalite would compute differently from transformers, one phrase each."""
    heads = cfg.get("num_attention_heads")
    quant = cfg.get("quantization_config")
    checks = [
        (f"{k}={cfg.get(k)!r} must be a positive integer", isinstance(cfg.get(k), int) and cfg[k] > 0) for k in _INTS]
    checks += [
        ("hidden_act must be silu", cfg.get("hidden_act", "silu") == "silu"),
        ("attention_bias must be false", not cfg.get("attention_bias")),
        (f"num_key_value_heads must equal num_attention_heads (MLA gives every head its own k and v), got "
         f"{cfg.get('num_key_value_heads')!r}", cfg.get("num_key_value_heads") in (None, heads)),
        (f"rms_norm_eps must be {LATENT_NORM_EPS} (transformers' MLA latent norms use it whatever the config says; "
         f"megalite's use rms_norm_eps), got {cfg.get('rms_norm_eps')!r}", cfg.get("rms_norm_eps") == LATENT_NORM_EPS),
        (f"scoring_func {cfg.get('scoring_func')!r} is not sigmoid (transformers' DeepseekV3 router)",
         cfg.get("scoring_func", "sigmoid") == "sigmoid"),
        (f"topk_method {cfg.get('topk_method')!r} is not noaux_tc (transformers' DeepseekV3 router)",
         cfg.get("topk_method", "noaux_tc") == "noaux_tc"),
        (f"moe_layer_freq {cfg.get('moe_layer_freq')!r} must be 1 (every layer after first_k_dense_replace is MoE)",
         cfg.get("moe_layer_freq", 1) == 1),
        (f"quantization_config {quant!r} is not DeepSeek's block FP8 (quant_method fp8, fmt e4m3, "
         f"weight_block_size {list(DEEPSEEK_BLOCK)})",
         quant is None or (isinstance(quant, dict) and quant.get("quant_method") == "fp8"
                           and quant.get("fmt", "e4m3") == "e4m3"
                           and list(quant.get("weight_block_size") or []) == list(DEEPSEEK_BLOCK)))]
    return [what for what, ok in checks if not ok]


def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model info for any supported HF config.json; DeepseekV3's here, the others by hf_moe."""
    if cfg.get("model_type") != "deepseek_v3":
        return hf_moe.info_from_hf(cfg)
    bad = _problems(cfg)
    if bad:
        raise CheckpointError(f"this {ARCH} config cannot be imported: {'; '.join(bad)}")
    given = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(given, dict):
        raise CheckpointError(f"this {ARCH} config cannot be imported: rope_parameters={given!r} is not an object")
    layers, experts = cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
    first_dense = cfg.get("first_k_dense_replace") or 0
    info: dict[str, Any] = {
        "arch": "llama", "num_layers": layers, "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_attention_heads"],
        "ffn_hidden_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
        "seq_len": cfg.get("max_position_embeddings", 4096), "make_vocab_divisible_by": 64,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)), "norm_eps": cfg["rms_norm_eps"],
        "rope_theta": given.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        **rope_scaling_info(given, cfg, "rope_parameters"),
        "mla": {"kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
                "qk_rope_head_dim": cfg["qk_rope_head_dim"], "qk_nope_head_dim": cfg["qk_nope_head_dim"],
                "v_head_dim": cfg["v_head_dim"]}}
    if experts and first_dense < layers + _mtp_layers(cfg):  # some MoE layer (an MTP block counts)
        groups = cfg.get("n_group") or 1
        info.update({**hf_moe.MOE_DEFAULTS, "moe_experts": experts, "moe_top_k": cfg["num_experts_per_tok"],
                     "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
                     "moe_shared_experts": cfg.get("n_shared_experts") or 0,
                     "moe_shared_ffn_hidden_size": cfg["moe_intermediate_size"], "moe_first_dense": first_dense,
                     "moe_every": 1, "moe_router": "deepseek", "moe_renorm": bool(cfg.get("norm_topk_prob", True)),
                     "moe_route_scale": cfg.get("routed_scaling_factor", 1.0), "moe_groups": groups,
                     "moe_group_top_k": cfg.get("topk_group") or groups,
                     "moe_aux_loss": 0.0, "moe_bias_rate": 0.001})  # the paper's gamma; a training choice, not in config.json
        top_k, group_top_k = info["moe_top_k"], info["moe_group_top_k"]
        wrong = [what for what, ok in (
            ("num_experts_per_tok must be an integer in [1, n_routed_experts]",
             isinstance(top_k, int) and 1 <= top_k <= experts),
            ("n_group must divide n_routed_experts", isinstance(groups, int) and groups > 0 and experts % groups == 0),
            ("topk_group must be an integer in [1, n_group]",
             isinstance(group_top_k, int) and 1 <= group_top_k <= groups),
            ("moe_intermediate_size must be a positive integer", _count(info["moe_ffn_hidden_size"], 1)),
            ("n_shared_experts must be an integer >= 0", _count(info["moe_shared_experts"], 0)),
            ("first_k_dense_replace must be an integer >= 0", _count(first_dense, 0)),
            ("routed_scaling_factor must be a positive number",
             0 < info["moe_route_scale"] < float("inf"))) if not ok]
        if wrong:
            raise CheckpointError(f"this {ARCH} config cannot be imported: {'; '.join(wrong)}")
    if _mtp_layers(cfg):
        info["mtp_layers"] = _mtp_layers(cfg)
    return info


def _count(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= 1 << 24


def _mtp_layers(cfg: dict[str, Any]) -> int:
    n = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0
    if not (isinstance(n, int) and 0 <= n <= 16):
        raise CheckpointError(f"this {ARCH} config cannot be imported: num_nextn_predict_layers={n!r} must be an "
                              "integer in [0, 16]")
    return n


def _mla(info: dict[str, Any]) -> MLAConfig:
    return MLAConfig(**info["mla"])


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for megalite model `info`: DeepseekV3 when it has MLA, else hf_moe's architectures."""
    if not info.get("mla"):
        return hf_moe.hf_config(info)
    s, m = hf_moe.settings(info), info["mla"]
    problems = [what for what, ok in (
        ("arch=llama", info["arch"] == "llama"), ("no qk_norm", not info.get("qk_norm")),
        (f"norm_eps={LATENT_NORM_EPS} (transformers' MLA latent norms)", info["norm_eps"] == LATENT_NORM_EPS),
        ("the deepseek router (moe_router)", s is None or s.router == "deepseek"),
        ("every layer after moe.first_dense MoE (moe.every=1)", s is None or s.every == 1),
        ("shared experts as wide as the routed ones",
         s is None or not s.shared_experts or s.shared_ffn_hidden_size == s.ffn_hidden_size),
        ("no capacity factor (dropless)", s is None or s.capacity_factor is None)) if not ok]
    if problems:
        raise CheckpointError(f"this MLA model has no {ARCH} equivalent: it needs {', '.join(problems)}")
    moe = ({"n_routed_experts": s.experts, "num_experts_per_tok": s.top_k, "moe_intermediate_size": s.ffn_hidden_size,
            "n_shared_experts": s.shared_experts, "first_k_dense_replace": s.first_dense, "n_group": s.groups,
            "topk_group": s.group_top_k, "routed_scaling_factor": s.route_scale, "norm_topk_prob": s.renorm}
           if s is not None else  # dense: every layer (and MTP block) before first_k_dense_replace
           {"n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": info["ffn_hidden_size"],
            "n_shared_experts": 0, "first_k_dense_replace": info["num_layers"] + info.get("mtp_layers", 0),
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True})
    return {"architectures": [ARCH], "model_type": "deepseek_v3", "vocab_size": info["vocab_size"],
            "hidden_size": info["hidden_size"], "intermediate_size": info["ffn_hidden_size"],
            "num_hidden_layers": info["num_layers"], "num_attention_heads": info["num_heads"],
            "num_key_value_heads": info["num_heads"], "kv_lora_rank": m["kv_lora_rank"],
            "q_lora_rank": m["q_lora_rank"] or None, "qk_rope_head_dim": m["qk_rope_head_dim"],
            "qk_nope_head_dim": m["qk_nope_head_dim"], "v_head_dim": m["v_head_dim"], **moe,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
            "max_position_embeddings": info["seq_len"], "rms_norm_eps": info["norm_eps"],
            "rope_theta": info["rope_theta"],
            "rope_parameters": {"rope_theta": info["rope_theta"], **hf_rope_parameters(info)},
            "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": bool(info["tie_embeddings"]), "num_nextn_predict_layers": info.get("mtp_layers", 0),
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


# ---------------------------------------------------------------------------------------- tensor names
def _block_rules(ours: str, theirs: str, layer: int, info: dict[str, Any]) -> list[hf.Rule]:
    """One decoder block's rules: megalite prefix `ours` (`layers.i.`), hub prefix `theirs` (`model.layers.i.`),
    MoE or dense by its global `layer` index."""
    m, s, f = info["mla"], hf_moe.settings(info), info["ffn_hidden_size"]
    attn = ["q_a", "q_a_norm", "q_b"] if m["q_lora_rank"] else ["q"]
    out: list[hf.Rule] = [(ours + "norm1.weight", [theirs + "input_layernorm.weight"], None, False)]
    out += [(f"{ours}attn.{x}.weight", [f"{theirs}self_attn.{HF_NAMES[x]}.weight"], None, False)
            for x in attn + ["kv_a", "kv_a_norm", "kv_b", "out"]]
    out.append((ours + "norm2.weight", [theirs + "post_attention_layernorm.weight"], None, False))
    p, q = ours + "mlp.", theirs + "mlp."
    if s is None or not s.is_moe_layer(layer):
        return out + [(p + "up.weight", [q + "gate_proj.weight", q + "up_proj.weight"], [f, f], False),
                      (p + "down.weight", [q + "down_proj.weight"], None, False)]
    out += [(p + "router.weight", [q + "gate.weight"], None, False),
            ("buffer/" + p + "router.bias", [q + "gate.e_score_correction_bias"], None, False),
            (p + "experts.up", [q + "experts.gate_up_proj"], None, False),
            (p + "experts.down", [q + "experts.down_proj"], None, False)]
    if s.shared_experts:
        width = s.shared_experts * s.shared_ffn_hidden_size
        out += [(p + "shared.up.weight", [q + "shared_experts.gate_proj.weight", q + "shared_experts.up_proj.weight"],
                 [width, width], False),
                (p + "shared.down.weight", [q + "shared_experts.down_proj.weight"], None, False)]
    return out


def rules(info: dict[str, Any]) -> list[hf.Rule]:
    """Every megalite tensor's hub name(s); the MTP layers' embedding and head copies last (export only)."""
    if not info.get("mla"):
        return hf_moe.rules(info)
    layers = info["num_layers"]
    out: list[hf.Rule] = [("embedding.weight", ["model.embed_tokens.weight"], None, False)]
    for i in range(layers):
        out += _block_rules(f"layers.{i}.", f"model.layers.{i}.", i, info)
    out.append(("final_norm.weight", ["model.norm.weight"], None, False))
    if not info["tie_embeddings"]:
        out.append(("head.weight", ["lm_head.weight"], None, False))
    copies: list[hf.Rule] = []
    for k in range(info.get("mtp_layers", 0)):
        ours, theirs = f"mtp.layers.{k}.", f"model.layers.{layers + k}."
        out += [(ours + "enorm.weight", [theirs + "enorm.weight"], None, False),
                (ours + "hnorm.weight", [theirs + "hnorm.weight"], None, False),
                (ours + "eh_proj", [theirs + "eh_proj.weight"], None, False)]
        out += _block_rules(ours + "block.", theirs, layers + k, info)
        out.append((ours + "norm.weight", [theirs + "shared_head.norm.weight"], None, False))
        copies += [("embedding.weight", [theirs + "embed_tokens.weight"], None, False),
                   ("embedding.weight" if info["tie_embeddings"] else "head.weight",
                    [theirs + "shared_head.head.weight"], None, False)]
    return out + copies


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The global shape of every megalite tensor `rules` names (unpadded vocabulary)."""
    if not info.get("mla"):
        return hf_moe.expected_shapes(info)
    h, f, v, heads = info["hidden_size"], info["ffn_hidden_size"], info["vocab_size"], info["num_heads"]
    m, s = _mla(info), hf_moe.settings(info)
    qk = heads * m.qk_head_dim
    tail = {"norm1.weight": (h,), "norm2.weight": (h,), "attn.q_a.weight": (m.q_lora_rank, h),
            "attn.q_a_norm.weight": (m.q_lora_rank,), "attn.q_b.weight": (qk, m.q_lora_rank),
            "attn.q.weight": (qk, h), "attn.kv_a.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            "attn.kv_a_norm.weight": (m.kv_lora_rank,),
            "attn.kv_b.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            "attn.out.weight": (h, heads * m.v_head_dim), "mlp.up.weight": (2 * f, h), "mlp.down.weight": (h, f),
            "enorm.weight": (h,), "hnorm.weight": (h,), "norm.weight": (h,), "eh_proj": (h, 2 * h)}
    if s is not None:
        tail |= {"mlp.router.weight": (s.experts, h), "mlp.router.bias": (s.experts,),
                 "mlp.experts.up": (s.experts, 2 * s.ffn_hidden_size, h),
                 "mlp.experts.down": (s.experts, h, s.ffn_hidden_size),
                 "mlp.shared.up.weight": (2 * s.shared_experts * s.shared_ffn_hidden_size, h),
                 "mlp.shared.down.weight": (h, s.shared_experts * s.shared_ffn_hidden_size)}
    top = {"embedding.weight": (v, h), "final_norm.weight": (h,), "head.weight": (v, h)}
    out = {}
    for name, _, _, _ in rules(info):
        bare = name.removeprefix("buffer/")
        if bare in top:
            out[name] = top[bare]
        else:  # layers.i.<tail>, mtp.layers.k.<tail> or mtp.layers.k.block.<tail>
            rest = bare.split(".", 3 if bare.startswith("mtp.") else 2)[-1].removeprefix("block.")
            out[name] = tail[rest]
    return out


# ---------------------------------------------------------------------------------------- tensor values
_ROPE_ROWS = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")


def _rope_permuted(name: str, t: torch.Tensor, info: dict[str, Any], to_hf: bool) -> torch.Tensor:
    """`t` with hf_mla's RoPE-row permutation applied where `name` is a projection that makes RoPE rows."""
    if not name.endswith(_ROPE_ROWS):
        return t
    short = name.rsplit("self_attn.", 1)[1]
    if to_hf:
        ours = next(k for k, v in HF_NAMES.items() if f"{v}.weight" == short)
        return attention_to_hf({f"{ours}.weight": t}, _mla(info), info["num_heads"], True)[short]
    (out,) = attention_from_hf({short: t}, _mla(info), info["num_heads"], True).values()
    return out


def export_tensor(name: str, t: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """A hub tensor as written: RoPE rows interleaved (rope_interleave true, as DeepSeek's checkpoints)."""
    return _rope_permuted(name, t, info, to_hf=True) if info.get("mla") else t


def source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    """The hub directory's tensors as `rules` name them: FP8 weights dequantised (fp32), per-expert tensors
    stacked, RoPE rows de-interleaved (when config.json's rope_interleave, true by default)."""
    raw_get, shape = src

    def dequantised(name: str) -> torch.Tensor:
        t = raw_get(name)
        if t.dtype != torch.float8_e4m3fn:
            return t
        if cfg.get("quantization_config") is None:
            raise CheckpointError(f"{name} is float8 but config.json has no quantization_config: not DeepSeek's "
                                  "block-FP8 release")
        return dequantize_block_fp8(t, raw_get(scale_inv_name(name)), DEEPSEEK_BLOCK, torch.float32, name)

    get, shape = hf_moe.hub_experts((dequantised, shape), info)
    if not info.get("mla") or not cfg.get("rope_interleave", True):
        return get, shape
    return (lambda name: _rope_permuted(name, get(name), info, to_hf=False)), shape


def _source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    """`source` for DeepseekV3, which also drops `mtp_layers` from `info` (before the rules are read) when the
    directory holds no MTP layer: transformers' save_pretrained writes none, though its config keeps
    num_nextn_predict_layers (1 by default); the hub's release has it."""
    if cfg.get("model_type") != "deepseek_v3":
        return hf_moe.hub_experts(src, info)
    if info.get("mtp_layers"):
        try:
            src[1](f"model.layers.{info['num_layers']}.eh_proj.weight")
        except CheckpointError:
            del info["mtp_layers"]
    return source(src, info, cfg)


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, _source, export_tensor)
