"""Named model sizes: the values that `model.preset` applies before the file and flags. A plain key is a `model`
field; a table (`moe`, `mla`, `mtp`) is another section's values, for architectures that need one."""

from __future__ import annotations

import types
from typing import Any, Mapping


def _frozen(d: dict[str, dict[str, object]]) -> Mapping[str, Mapping[str, object]]:
    return types.MappingProxyType({k: types.MappingProxyType({f: types.MappingProxyType(v) if isinstance(v, dict)
                                                               else v for f, v in fields.items()})
                                   for k, fields in d.items()})


# DeepSeek-V3's released RoPE scaling (its HF config's rope_scaling): 4K pretraining extended 40x.
_YARN_40 = dict(rope_scaling="yarn", rope_factor=40.0, rope_original_max_positions=4096, rope_beta_fast=32.0,
                rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0)

# The layer-pattern and variant fields of gpt-oss and Gemma 3 (megalite/model/pattern.py): sizes apart.
_GPT_OSS = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=128, attn_sinks=True, attn_bias=True,
                mlp="clamped_swiglu", swiglu_limit=7.0, swiglu_alpha=1.702, mlp_bias=True, norm_eps=1e-5)
_GEMMA3 = dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=512, rope_theta=1e6,
               rope_local_theta=10000.0, qk_norm=True, sandwich_norm=True, mlp="geglu", embed_scale=True,
               query_pre_attn_scalar=256.0, tie_embeddings=True, norm_eps=1e-6)

# Values of well-known sizes (read-only). Sources: GPT-2 (Radford et al. 2019),
# Pythia-160m-like llama, Llama 3.2 1B (GQA 32/8, tied embeddings), Llama 2 7B.
PRESETS: Mapping[str, Mapping[str, object]] = _frozen({
    "tiny": dict(arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, seq_len=128),
    "gpt2-tiny": dict(arch="gpt2", num_layers=4, hidden_size=128, num_heads=4, seq_len=128),
    "gpt2-small": dict(arch="gpt2", num_layers=12, hidden_size=768, num_heads=12, seq_len=1024,
                       vocab_size=50257),
    "gpt2-medium": dict(arch="gpt2", num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024,
                        vocab_size=50257),
    "llama-160m": dict(arch="llama", num_layers=12, hidden_size=768, num_heads=12, ffn_hidden_size=2048,
                       seq_len=2048),
    "llama-1b": dict(arch="llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                     ffn_hidden_size=8192, seq_len=2048, vocab_size=128256, rope_theta=500000.0,
                     tie_embeddings=True),
    "llama-7b": dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008,
                     seq_len=4096, vocab_size=32000),
    # Mixtures of experts (docs/moe.md). tiny-moe trains on the demo corpus in minutes on a CPU; the three
    # published shapes are for the estimator (Mixtral 8x7B: Jiang et al. 2024; Qwen3-30B-A3B: its HF config;
    # DeepSeek-V3: Liu et al. 2024 and its HF config: multi-head latent attention (docs/mla.md), YaRN as
    # released, the group-limited sigmoid router with a shared expert, one multi-token prediction module, docs/mtp.md).
    "tiny-moe": dict(arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, seq_len=128,
                     moe=dict(experts=8, top_k=2, ffn_hidden_size=128, router="qwen3", aux_loss=0.01, z_loss=0.001)),
    "mixtral-8x7b": dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, seq_len=4096, vocab_size=32000, rope_theta=1e6,
                         moe=dict(experts=8, top_k=2, router="mixtral", aux_loss=0.02)),
    "qwen3-30b-a3b": dict(arch="llama", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                          ffn_hidden_size=6144, seq_len=4096, vocab_size=151936, rope_theta=1e6,
                          moe=dict(experts=128, top_k=8, ffn_hidden_size=768, router="qwen3", aux_loss=0.001)),
    "deepseek-v3": dict(arch="llama", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128,
                        ffn_hidden_size=18432, seq_len=4096, vocab_size=129280, norm_eps=1e-6, **_YARN_40,
                        moe=dict(experts=256, top_k=8, ffn_hidden_size=2048, shared_experts=1, first_dense=3,
                                 router="deepseek", route_scale=2.5, groups=8, group_top_k=4),
                        mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                 v_head_dim=128),
                        mtp=dict(num_layers=1)),
    # DeepSeek-V3's architecture at toy width (tests and the README's example): MLA with v_head_dim != the q/k
    # head dim, YaRN on (4 x 32 positions), 8 experts in 4 groups of which 2 are kept, a shared expert, layer 0
    # dense, one MTP module.
    "tiny-deepseek": dict(arch="llama", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=4,
                          ffn_hidden_size=256, seq_len=128, norm_eps=1e-6, rope_scaling="yarn", rope_factor=4.0,
                          rope_original_max_positions=32, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
                          rope_mscale_all_dim=1.0,
                          moe=dict(experts=8, top_k=2, ffn_hidden_size=64, shared_experts=1, first_dense=1,
                                   router="deepseek", route_scale=2.5, groups=4, group_top_k=2, seq_aux_loss=1e-4),
                          mla=dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                   v_head_dim=24),
                          mtp=dict(num_layers=1)),
    # Layer patterns and attention variants (docs/attention.md). gpt-oss-20b and gemma3-1b are the published shapes
    # (their HF configs and transformers' GptOssConfig / Gemma3TextConfig defaults) for the estimator and planner:
    # gpt-oss alternates 128-token sliding windows with full layers, learnable sinks, q/k/v/o biases, 32 experts
    # (top-4 softmax over the chosen logits, router and expert biases, the clamped SwiGLU), YaRN 32x over 4K;
    # Gemma 3 1B has 5 local layers (window 512, RoPE base 10k) to 1 global (base 1M), q/k norm, pre- and post-norms,
    # GeGLU, embeddings x sqrt(h), query_pre_attn_scalar 256. The tiny ones train on the demo corpus on a CPU.
    "gpt-oss-20b": dict(arch="llama", num_layers=24, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                        ffn_hidden_size=2880, seq_len=4096, vocab_size=201088, rope_theta=150000.0,
                        rope_scaling="yarn", rope_factor=32.0, rope_original_max_positions=4096,
                        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False, **_GPT_OSS,
                        moe=dict(experts=32, top_k=4, router="mixtral", router_bias=True, aux_loss=0.001)),
    "tiny-gpt-oss": dict(arch="llama", num_layers=4, hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=16,
                         ffn_hidden_size=128, seq_len=128, **{**_GPT_OSS, "sliding_window": 32},
                         moe=dict(experts=8, top_k=2, router="mixtral", router_bias=True, aux_loss=0.01)),
    "gemma3-1b": dict(arch="llama", num_layers=26, hidden_size=1152, num_heads=4, num_kv_heads=1, head_dim=256,
                      ffn_hidden_size=6912, seq_len=32768, vocab_size=262144, **_GEMMA3),
    "tiny-gemma3": dict(arch="llama", num_layers=6, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                        ffn_hidden_size=384, seq_len=128, **{**_GEMMA3, "sliding_window": 32,
                                                             "query_pre_attn_scalar": 32.0}),
    # Qwen3.5's text model at transformers' Qwen3_5TextConfig defaults (for the estimator and planner; docs/
    # linear-attention.md): three Gated DeltaNet layers (16 key heads, 32 value heads of 128, conv 4) beside each
    # gated full-attention layer (16 heads of 256, 4 kv heads, q/k norm, RoPE on a quarter of each head).
    "qwen3.5": dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=16, num_kv_heads=4, head_dim=256,
                    ffn_hidden_size=12288, seq_len=4096, vocab_size=248320, rope_theta=1e7, norm_eps=1e-6,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    attn_output_gate="element", qk_norm=True, rope_fraction=0.25),
})


def section_values(preset: Mapping[str, Any], section: str = "model") -> dict[str, Any]:
    """A preset's values for one config section, by field name (plain keys are the model section's)."""
    if section == "model":
        return {k: v for k, v in preset.items() if not isinstance(v, Mapping)}
    table = preset.get(section, {})
    return dict(table) if isinstance(table, Mapping) else {}
