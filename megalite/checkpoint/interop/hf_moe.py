"""Hugging Face MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen3ForCausalLM: their configs and weights to and
from megalite's (the dense Llama / GPT-2 mapping is `megalite.checkpoint.interop.hf`; `MAPPING` is both together, what
tools/import_hf.py and tools/export_hf.py use).

Names (megalite's global names on the left; everything else maps as Llama's):

  layers.i.attn.q_norm.weight  model.layers.i.self_attn.q_norm.weight        [head_dim]   (Qwen3, qk_norm)
  layers.i.attn.k_norm.weight  model.layers.i.self_attn.k_norm.weight        [head_dim]
  layers.i.mlp.router.weight   model.layers.i.mlp.gate.weight                [E, h]       (a MoE layer)
  layers.i.mlp.experts.up      model.layers.i.mlp.experts.gate_up_proj       [E, 2F, h], rows [gate; up]
  layers.i.mlp.experts.down    model.layers.i.mlp.experts.down_proj          [E, h, F]

transformers (>= 5) keeps each layer's experts stacked exactly like megalite's `Experts`, so no tensor is cut
or transposed. Routers: Mixtral's (softmax over all experts, top-k, renormalised) is megalite's `mixtral`
(softmax over the top-k logits), equal up to round-off; Qwen3-MoE's (softmax over all, top-k, renormalised
if `norm_topk_prob`) is megalite's `qwen3` with `moe.renorm = norm_topk_prob`. Qwen3-MoE's MoE layers are
those with (i + 1) % decoder_sparse_step == 0: megalite's moe.first_dense = step - 1, moe.every = step.

Auxiliary loss: transformers adds router_aux_loss_coef x load_balancing_loss_func to its loss only with
output_router_logits (so the import sets moe.aux_loss to the coefficient only then). Its function pools the
assignment counts and probabilities of ALL layers before the product, E sum_i f_i P_i over L x T rows;
megalite (as Megatron) takes the mean over the MoE layers of each layer's E sum_i f_i P_i, which a pipeline
stage can compute alone. The two are equal with one MoE layer; with several, megalite's is the mean of
transformers' function applied to each layer (tests/test_hf_moe_train.py checks both).

Refused by name: Qwen2-MoE (no converter; its gated shared expert is hf_qwen3_5.py's moe.shared_gate),
DeepSeek-V2, and every field megalite would not compute as transformers does. DeepSeek-V3 is
megalite/checkpoint/interop/hf_deepseek.py's (whose MAPPING the tools use).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megalite.checkpoint.interop import hf
from megalite.checkpoint.index_check import MAX_DIM
from megalite.checkpoint.layout import moe_from_info
from megalite.errors import CheckpointError
from megalite.moe.config import MoEConfig

NAMES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}
REFUSED = {
    "qwen2_moe": "its converter is not written (its gated shared expert, shared_expert_gate, is megalite's "
                 "moe.shared_gate: Qwen3-Next and Qwen3.5-MoE import with it)",
    "deepseek_v2": "its MoE routing (greedy / group_limited_greedy softmax) is not megalite's; DeepSeek-V3 imports",
    "deepseek_v3": "read it with megalite.checkpoint.interop.hf_deepseek.MAPPING (as tools/import_hf.py does)",
}
_SHARED_KEYS = ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size")
# MoE defaults for what HF configs do not carry (no z-loss, dropless, no DeepSeek bias).
MOE_DEFAULTS = {"moe_shared_experts": 0, "moe_shared_ffn_hidden_size": 0, "moe_route_scale": 1.0, "moe_groups": 1,
                 "moe_group_top_k": 1, "moe_bias_rate": 0.0, "moe_z_loss": 0.0, "moe_capacity_factor": None,
                 "moe_shared_gate": False}


# ----------------------------------------------------------------------------------------- config.json
def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model info (dims + moe_* + qk_norm) for an HF config.json of any supported architecture."""
    kind = cfg.get("model_type")
    if kind in ("llama", "gpt2"):
        return hf.info_from_hf(cfg)
    if kind in REFUSED:
        raise CheckpointError(f"HF model_type {kind!r} is not supported: {REFUSED[kind]}")
    if kind not in NAMES:
        raise CheckpointError(f"HF model_type {kind!r} is not supported: import LlamaForCausalLM, GPT2LMHeadModel, "
                              f"{', '.join(NAMES.values())}")
    name = NAMES[kind]
    bad = _unsupported(cfg, kind)
    if bad:
        raise CheckpointError(f"this {name} config cannot be imported: {'; '.join(bad)}")
    try:  # the attention and the rest are Llama's: its checks (RoPE scaling, act, biases) hold
        info = hf.info_from_hf({**cfg, "model_type": "llama", "mlp_bias": False, "head_dim": None})
    except CheckpointError as e:
        raise CheckpointError(str(e).replace("this Llama config", f"this {name} config")) from e
    hd = cfg.get("head_dim")
    if hd is not None and hd != info["hidden_size"] // info["num_heads"]:  # Qwen3's heads are wider: 128
        if not (isinstance(hd, int) and not isinstance(hd, bool) and 2 <= hd <= MAX_DIM["num_heads"] and hd % 2 == 0):
            raise CheckpointError(f"this {name} config cannot be imported: head_dim={hd!r} must be an even integer "
                                  f"in [2, {MAX_DIM['num_heads']}]")
        info["head_dim"] = hd
    if kind != "mixtral":
        info["qk_norm"] = True
    if kind == "qwen3":
        return info
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k, step = cfg.get("num_experts_per_tok"), cfg.get("decoder_sparse_step", 1)
    ffn = cfg["intermediate_size"] if kind == "mixtral" else cfg.get("moe_intermediate_size")
    ints = {"num_experts": experts, "num_experts_per_tok": top_k, "decoder_sparse_step": step,
            "moe_intermediate_size": ffn}
    wrong = [f"{k}={v!r} must be an integer in [1, {MAX_DIM['ffn_hidden_size']}]" for k, v in ints.items()
             if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIM["ffn_hidden_size"])]
    if not wrong and isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        wrong.append(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    if wrong:
        raise CheckpointError(f"this {name} config cannot be imported: {'; '.join(wrong)}")
    coef = cfg.get("router_aux_loss_coef", 0.0)
    if not (isinstance(coef, (int, float)) and not isinstance(coef, bool) and 0 <= coef < float("inf")):
        raise CheckpointError(f"this {name} config cannot be imported: router_aux_loss_coef={coef!r} must be a "
                              "number >= 0")
    return {**info, **MOE_DEFAULTS, "moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": ffn,
            "moe_first_dense": step - 1, "moe_every": step, "moe_router": "mixtral" if kind == "mixtral" else "qwen3",
            "moe_renorm": bool(cfg.get("norm_topk_prob", True)) if kind != "mixtral" else True,
            "moe_aux_loss": float(coef) if cfg.get("output_router_logits") else 0.0}


def _unsupported(cfg: dict[str, Any], kind: str) -> list[str]:
    """What in this config megalite would compute differently from transformers, one phrase each."""
    layer_types = cfg.get("layer_types") or []
    checks = [
        ("sliding-window attention is not supported (use_sliding_window / sliding_window)",
         not cfg.get("use_sliding_window") and (kind != "mixtral" or cfg.get("sliding_window") is None)),
        ("layer_types other than full_attention are not supported",
         isinstance(layer_types, list) and all(t == "full_attention" for t in layer_types)),
        ("attention_bias must be false", not cfg.get("attention_bias")),
        (f"the router's scoring_func {cfg.get('scoring_func')!r} is not softmax (Mixtral's and Qwen3-MoE's router)",
         cfg.get("scoring_func", "softmax") == "softmax")]
    if kind == "mixtral":
        checks += [("router_jitter_noise must be 0", not cfg.get("router_jitter_noise")),
                   ("Mixtral has no shared experts (" + ", ".join(k for k in _SHARED_KEYS if cfg.get(k)) + ")",
                    not any(cfg.get(k) for k in _SHARED_KEYS))]
    if kind == "qwen3_moe":
        checks += [("mlp_only_layers must be empty (dense layers only through decoder_sparse_step)",
                    not cfg.get("mlp_only_layers")),
                   ("shared experts are not part of Qwen3-MoE (" + ", ".join(k for k in _SHARED_KEYS if cfg.get(k))
                    + ")", not any(cfg.get(k) for k in _SHARED_KEYS))]
    return [what for what, ok in checks if not ok]


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for the HF architecture that computes megalite model `info`; refuses what none does."""
    qk, s = bool(info.get("qk_norm")), settings(info)
    if s is None and not qk:
        return hf.hf_config(info)
    if info["arch"] != "llama":
        raise CheckpointError("a MoE or qk_norm model exports only with arch=llama")
    base = {k: v for k, v in hf.hf_config(info).items() if k != "mlp_bias"}
    if s is None:
        return {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "sliding_window": None}
    # The router z-loss is a training loss, not part of the forward (HF configs have no field for it): not a
    # reason to refuse, like the learning rate it is simply not carried.
    problems = [what for what, ok in (
        ("shared experts", not s.shared_experts),
        ("a capacity factor (HF MoE models are dropless)", s.capacity_factor is None))
        if not ok]
    moe = {"num_experts_per_tok": s.top_k, "router_aux_loss_coef": s.aux_loss, "output_router_logits": s.aux_loss > 0}
    # megalite's mixtral router (softmax over the top-k logits) is qwen3's with renormalisation (softmax over all,
    # top-k, divided by their sum): the same weights, exp(l_i) / sum over the k of exp(l_j).
    renorm = s.renorm if s.router == "qwen3" else True
    if s.router in ("mixtral", "qwen3") and renorm and not qk:
        if s.first_dense or s.every != 1:
            problems.append("dense layers (Mixtral's layers are all MoE)")
        if problems:
            raise CheckpointError(f"this MoE model has no Hugging Face equivalent: {', '.join(problems)}")
        return {**base, **moe, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": s.ffn_hidden_size, "num_local_experts": s.experts, "router_jitter_noise": 0.0,
                "sliding_window": None}
    if s.router in ("mixtral", "qwen3") and qk:
        if s.first_dense != s.every - 1:
            problems.append(f"MoE layers from {s.first_dense} every {s.every} (Qwen3-MoE's are those with "
                            "(i + 1) % decoder_sparse_step == 0)")
        if problems:
            raise CheckpointError(f"this MoE model has no Hugging Face equivalent: {', '.join(problems)}")
        return {**base, **moe, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "moe_intermediate_size": s.ffn_hidden_size, "num_experts": s.experts, "decoder_sparse_step": s.every,
                "norm_topk_prob": renorm, "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}
    raise CheckpointError("this MoE model has no Hugging Face equivalent: without qk_norm, the mixtral router or "
                          "qwen3 with moe.renorm is Mixtral; with qk_norm, mixtral or qwen3 is Qwen3-MoE; "
                          f"this one has moe.router={s.router}, moe.renorm={s.renorm} and qk_norm={qk}")


def settings(info: dict[str, Any]) -> MoEConfig | None:
    return moe_from_info(info).resolved(info["ffn_hidden_size"])


# ---------------------------------------------------------------------------------------- tensor names
def rules(info: dict[str, Any]) -> list[hf.Rule]:
    """The mapping of every megalite parameter to its HF tensor(s): Llama's, with MoE layers and q/k norms."""
    s = settings(info)
    out: list[hf.Rule] = []
    for rule in hf.rules(info):
        name = rule[0]
        parts = name.split(".")
        if name.startswith("layers.") and parts[2] == "mlp" and s is not None and s.is_moe_layer(int(parts[1])):
            if parts[3] == "down":
                continue
            p = f"model.layers.{parts[1]}.mlp."
            out += [(f"layers.{parts[1]}.mlp.router.weight", [p + "gate.weight"], None, False),
                    (f"layers.{parts[1]}.mlp.experts.up", [p + "experts.gate_up_proj"], None, False),
                    (f"layers.{parts[1]}.mlp.experts.down", [p + "experts.down_proj"], None, False)]
            continue
        out.append(rule)
        if info.get("qk_norm") and name.endswith("attn.qkv.weight"):
            p = f"model.layers.{parts[1]}.self_attn."
            out += [(f"layers.{parts[1]}.attn.{x}_norm.weight", [p + f"{x}_norm.weight"], None, False) for x in "qk"]
    return out


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The global shape of every megalite parameter (unpadded vocabulary), MoE layers and q/k norms included."""
    dense = hf.expected_shapes(info)
    s, h = settings(info), info["hidden_size"]
    hd = info.get("head_dim") or h // info["num_heads"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name, _, _, _ in rules(info):
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (hd,)
        elif s is not None and name.endswith("mlp.router.weight"):
            shapes[name] = (s.experts, h)
        elif s is not None and name.endswith("mlp.experts.up"):
            shapes[name] = (s.experts, 2 * s.ffn_hidden_size, h)
        elif s is not None and name.endswith("mlp.experts.down"):
            shapes[name] = (s.experts, h, s.ffn_hidden_size)
        else:
            shapes[name] = dense[name]
    return shapes


def hub_experts(src: hf.TensorSource, info: dict[str, Any]) -> hf.TensorSource:
    """`src` that also reads the fused names `rules` give from the per-expert tensors, where the fused ones are
    absent: save_pretrained (transformers 5) and the Hub store Mixtral's layer as block_sparse_moe.gate and
    block_sparse_moe.experts.j.w1 (gate) / w3 (up) / w2 (down), Qwen3-MoE's as mlp.gate and
    mlp.experts.j.{gate,up,down}_proj; each expert's [gate; up] rows are stacked into gate_up_proj [E, 2F, h]."""
    get, shape = src
    s = settings(info)
    if s is None:
        return src
    mixtral = s.router == "mixtral"
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    def legacy(name: str) -> list[list[str]] | None:
        """Per expert, the tensors whose rows make expert e's slice of `name` (None: `name` is not fused)."""
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)", name)
        if m is None or s is None:
            return None
        try:
            shape(name)
            return None  # stored fused (transformers' in-memory names, as megalite exports them)
        except CheckpointError:
            pass
        p = f"model.layers.{m[1]}.{'block_sparse_moe' if mixtral else 'mlp'}."
        if m[2] == "gate.weight":
            return [[p + "gate.weight"]]
        names = parts[:2] if m[2] == "experts.gate_up_proj" else parts[2:]
        return [[f"{p}experts.{e}.{x}.weight" for x in names] for e in range(s.experts)]

    def shape_of(name: str) -> list[int]:
        groups = legacy(name)
        if groups is None:
            return shape(name)
        each = [[shape(n) for n in g] for g in groups]
        rows = [[sum(x[0] for x in e)] + e[0][1:] for e in each]
        if any(r != rows[0] or len(e[0]) != 2 for r, e in zip(rows, each)):
            raise CheckpointError(f"the per-expert tensors of {name} ({groups[0][0]}, ...) have shapes {each}: "
                                  "not one 2-D shape per expert")
        return rows[0] if len(groups) == 1 and groups[0][0].endswith("gate.weight") else [len(groups)] + rows[0]

    def tensor(name: str) -> torch.Tensor:
        groups = legacy(name)
        if groups is None:
            return get(name)
        if len(groups) == 1 and groups[0][0].endswith("gate.weight"):
            return get(groups[0][0])
        return torch.stack([torch.cat([get(n) for n in g]) for g in groups])

    return tensor, shape_of


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, lambda src, info, cfg: hub_experts(src, info))
