"""Every Hugging Face architecture megalite reads and writes, in one `MAPPING`: what tools/import_hf.py,
tools/export_hf.py and `train.init_from` use.

  by config.json's model_type    gpt_oss -> hf_gpt_oss, gemma3_text -> hf_gemma3, qwen3_5(_moe)(_text) and
                                 qwen3_next -> hf_qwen3_5, anything else -> hf_deepseek
                                 (DeepseekV3; it hands Mixtral / Qwen3(-MoE) to hf_moe, Llama / GPT-2 to hf)
  by a megalite model's info     attention sinks -> gpt-oss, post-norms or the embedding scale -> Gemma 3,
                                 linear_attention layers, a gated shared expert or the per-element output gate
                                 with q/k norm -> Qwen3.5 / Qwen3.5-MoE / Qwen3-Next, else
                                 hf_deepseek's chain, which computes none of the layer pattern and variant fields:
                                 a model with any of them set is refused there by name, not written as a Llama
                                 that would compute another function.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpoint.interop import hf, hf_deepseek, hf_gemma3, hf_gpt_oss, hf_moe, hf_qwen3_5
from megalite.errors import CheckpointError
from megalite.model.pattern import VARIANT_DEFAULTS

FAMILIES = {"gpt_oss": (hf_gpt_oss.MAPPING, hf_gpt_oss.claims), "gemma3_text": (hf_gemma3.MAPPING, hf_gemma3.claims),
            **{kind: (hf_qwen3_5.MAPPING, hf_qwen3_5.claims) for kind in [*hf_qwen3_5.ARCHS, *hf_qwen3_5.COMPOSITE]}}
REFUSED = {"gemma3": "it is Gemma3ForConditionalGeneration (text and vision): megalite imports the text-only "
                     "Gemma3ForCausalLM (model_type gemma3_text, as google/gemma-3-1b is)"}
# The layer-pattern and variant fields (megalite/model/pattern.py) at their defaults, and the router bias: the older
# architectures compute none of them (YaRN's truncate they all take: hf_rope writes it).
PLAIN = {**{k: v for k, v in VARIANT_DEFAULTS.items() if k != "rope_truncate"}, "moe_router_bias": False,
         "moe_shared_gate": False}


def _by_info(info: dict[str, Any]) -> hf.HFMapping:
    for mapping, claims in dict(FAMILIES.values()).items():
        if claims(info):
            return mapping
    return hf_deepseek.MAPPING


def _by_config(cfg: dict[str, Any]) -> hf.HFMapping:
    kind = cfg.get("model_type")
    if kind in REFUSED:
        raise CheckpointError(f"HF model_type {kind!r} is not supported: {REFUSED[kind]}")
    known = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", **hf_moe.NAMES, "deepseek_v3": hf_deepseek.ARCH,
             "gpt_oss": hf_gpt_oss.ARCH, "gemma3_text": hf_gemma3.ARCH, **hf_qwen3_5.ARCHS,
             **{k: hf_qwen3_5.ARCHS[v] for k, v in hf_qwen3_5.COMPOSITE.items()}}
    if kind not in known and kind not in hf_moe.REFUSED:
        raise CheckpointError(f"HF model_type {kind!r} is not supported: import {', '.join(known.values())}")
    return FAMILIES[kind][0] if kind in FAMILIES else hf_deepseek.MAPPING


def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    return _by_config(cfg).info_from_hf(cfg)


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    mapping = _by_info(info)
    if mapping is hf_deepseek.MAPPING:
        odd = [f"model.{k}={info[k]!r}" if not k.startswith("moe_") else f"moe.{k[4:]}={info[k]!r}"
               for k, plain in PLAIN.items() if k in info and info[k] != plain
               and not (k == "mlp" and info[k] == ("swiglu" if info["arch"] == "llama" else "gelu"))]
        if odd:
            raise CheckpointError(f"this model has no Hugging Face equivalent megalite writes: {', '.join(odd)} "
                                  "(gpt-oss needs attention sinks, Gemma 3 post-norms and the embedding scale, "
                                  "Qwen3.5 / Qwen3-Next linear_attention layers or the element output gate with "
                                  "q/k norm; Llama, Qwen3, Mixtral and DeepSeek-V3 have none of these)")
    return mapping.hf_config(info)


def rules(info: dict[str, Any]) -> list[hf.Rule]:
    return _by_info(info).rules(info)


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return _by_info(info).expected_shapes(info)


def source(src: hf.TensorSource, info: dict[str, Any], cfg: dict[str, Any]) -> hf.TensorSource:
    read = _by_config(cfg).source
    return read(src, info, cfg) if read is not None else src


def export_tensor(name: str, t: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    write = _by_info(info).export_tensor
    return write(name, t, info) if write is not None else t


def export_shape(name: str, shape: tuple[int, ...], info: dict[str, Any]) -> tuple[int, ...]:
    reshape = _by_info(info).export_shape
    return reshape(name, shape, info) if reshape is not None else shape


MAPPING = hf.HFMapping(info_from_hf, hf_config, rules, expected_shapes, source, export_tensor, export_shape)
