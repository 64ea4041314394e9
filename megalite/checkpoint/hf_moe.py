"""Hugging Face mixtures of experts: MixtralForCausalLM's weights and config to and from a megalite GPT.

Names (megalite's global names on the left; the rest of the model maps as Llama's, `megalite.checkpoint.hf`):

  layers.i.mlp.router.weight   model.layers.i.mlp.gate.weight                [E, h]
  layers.i.mlp.experts.up      model.layers.i.mlp.experts.gate_up_proj       [E, 2F, h], rows [gate; up]
  layers.i.mlp.experts.down    model.layers.i.mlp.experts.down_proj          [E, h, F]

transformers (>= 5) keeps each layer's experts stacked exactly like megalite's `Experts`, so no tensor is
cut or transposed. Mixtral's router (softmax over all experts, top-k, renormalised) is megalite's
`mixtral` router (softmax over the top-k logits): the same weights up to round-off.

Qwen3MoeForCausalLM is refused with one line: its attention normalises each head's q and k (q_norm,
k_norm), which megalite's attention does not have; its router alone is megalite's `qwen3` (tested
against transformers' in tests/test_moe_layer.py). Every other field megalite cannot compute is refused too.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpoint.hf import rules
from megalite.checkpoint.layout import model_info
from megalite.errors import CheckpointError
from megalite.model.gpt import GPT
from megalite.moe.settings import MoESettings


def moe_fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite's model.moe_* values for an HF MoE config.json; a CheckpointError naming what is unsupported."""
    kind = cfg.get("model_type")
    if kind == "qwen3_moe":
        raise CheckpointError("Qwen3MoeForCausalLM cannot be imported yet: its attention's per-head q/k RMSNorm "
                              "(q_norm, k_norm) is not in megalite's attention (the qwen3 router is)")
    if kind != "mixtral":
        raise CheckpointError(f"HF MoE model_type {kind!r} is not supported: MixtralForCausalLM only")
    bad = [what for what, ok in (
        ("router_jitter_noise must be 0", not cfg.get("router_jitter_noise")),
        ("sliding_window is not supported", cfg.get("sliding_window") is None),
        ("hidden_act must be silu", cfg.get("hidden_act", "silu") == "silu")) if not ok]
    if bad:
        raise CheckpointError(f"this Mixtral config cannot be imported: {'; '.join(bad)}")
    return {"moe_experts": cfg["num_local_experts"], "moe_top_k": cfg["num_experts_per_tok"],
            "moe_ffn_hidden_size": cfg["intermediate_size"], "moe_router": "mixtral",
            "moe_aux_loss": float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0}


def hf_moe_config(m: Any) -> dict[str, Any]:
    """config.json of a MixtralForCausalLM with the dims of megalite model config `m` (mixtral router)."""
    s = MoESettings.from_model(m)
    if s is None or s.router != "mixtral" or s.shared or s.first_dense or s.every != 1 or s.capacity_factor:
        raise CheckpointError("only a MoE model with the mixtral router, every layer MoE, no shared experts and "
                              "no capacity factor exports as MixtralForCausalLM")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": m.hidden_size,
            "intermediate_size": s.ffn, "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
            "num_hidden_layers": m.num_layers, "head_dim": m.hidden_size // m.num_heads, "vocab_size": m.vocab_size,
            "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
            "num_local_experts": s.experts, "num_experts_per_tok": s.top_k, "router_aux_loss_coef": s.aux_loss,
            "router_jitter_noise": 0.0, "sliding_window": None, "hidden_act": "silu",
            "tie_word_embeddings": bool(m.tie_embeddings), "torch_dtype": "float32"}


def name_map(m: Any) -> dict[str, list[str]]:
    """megalite name -> the HF tensor names whose rows (concatenated) make it, for model config `m`."""
    info = model_info(m)
    table = {name: hf for name, hf, _, _ in rules(info)}
    s = MoESettings.from_model(m)
    for i in range(m.num_layers):
        if s is None or not s.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp."
        del table[f"layers.{i}.mlp.up.weight"], table[f"layers.{i}.mlp.down.weight"]
        table[f"layers.{i}.mlp.router.weight"] = [p + "gate.weight"]
        table[f"layers.{i}.mlp.experts.up"] = [p + "experts.gate_up_proj"]
        table[f"layers.{i}.mlp.experts.down"] = [p + "experts.down_proj"]
    return table


@torch.no_grad()
def load_hf_weights(model: GPT, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy an HF Mixtral state dict into a one-process megalite GPT (tp = ep = 1; padded vocab rows stay)."""
    params = dict(model.named_parameters())
    for name, hf_names in name_map(model.cfg).items():
        if name not in params:
            continue
        value = torch.cat([hf_state[n] for n in hf_names], dim=0)
        params[name][: value.shape[0]].copy_(value)


@torch.no_grad()
def hf_weights(model: GPT) -> dict[str, torch.Tensor]:
    """The inverse: an HF Mixtral state dict from a one-process megalite GPT."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, hf_names in name_map(model.cfg).items():
        if name not in params:
            continue
        value = params[name].detach()
        if name in ("embedding.weight", "head.weight"):
            value = value[: model.cfg.vocab_size]
        sizes = [value.shape[0] // len(hf_names)] * len(hf_names)
        if name.endswith("attn.qkv.weight"):
            c: Any = model.cfg
            hd = c.hidden_size // c.num_heads
            sizes = [c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd]
        for n, piece in zip(hf_names, value.split(sizes)):
            out[n] = piece.clone()
    return out
