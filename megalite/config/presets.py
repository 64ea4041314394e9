"""Named model sizes: the `model` section values that `model.preset` applies before the file and flags
(and, for a mixture of experts, the `moe` section's, as the table `moe`)."""

from __future__ import annotations

import types
from typing import Mapping


def _frozen(d: dict[str, dict[str, object]]) -> Mapping[str, Mapping[str, object]]:
    return types.MappingProxyType({k: types.MappingProxyType({f: types.MappingProxyType(v) if isinstance(v, dict)
                                                               else v for f, v in fields.items()})
                                   for k, fields in d.items()})


# Model-section values of well-known sizes (read-only). Sources: GPT-2 (Radford et al. 2019),
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
    # DeepSeek-V3: Liu et al. 2024, without its multi-head latent attention and multi-token prediction:
    # plain GQA attention of the same width stands in for MLA here).
    "tiny-moe": dict(arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, seq_len=128,
                     moe=dict(experts=8, top_k=2, ffn_hidden_size=128, router="qwen3", aux_loss=0.01, z_loss=0.001)),
    "mixtral-8x7b": dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, seq_len=4096, vocab_size=32000, rope_theta=1e6,
                         moe=dict(experts=8, top_k=2, router="mixtral", aux_loss=0.02)),
    "qwen3-30b-a3b": dict(arch="llama", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                          ffn_hidden_size=6144, seq_len=4096, vocab_size=151936, rope_theta=1e6,
                          moe=dict(experts=128, top_k=8, ffn_hidden_size=768, router="qwen3", aux_loss=0.001)),
    "deepseek-v3": dict(arch="llama", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128,
                        ffn_hidden_size=18432, seq_len=4096, vocab_size=129280,
                        moe=dict(experts=256, top_k=8, ffn_hidden_size=2048, shared_experts=1, first_dense=3,
                                 router="deepseek", route_scale=2.5, groups=8, group_top_k=4)),
})
