"""Named model sizes: the `model` section values that `model.preset` applies before the file and flags."""

from __future__ import annotations

import types
from typing import Mapping


def _frozen(d: dict[str, dict[str, object]]) -> Mapping[str, Mapping[str, object]]:
    return types.MappingProxyType({k: types.MappingProxyType(v) for k, v in d.items()})


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
})
