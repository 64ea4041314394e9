"""Tiny configs of the layer-pattern models for the tests (tests/test_layer_pattern*.py): a gpt-oss-like one and a
Gemma 3-like one, small enough for CPU but unlike the real ones where that makes the features bite (windows
shorter than the sequence, a clamp reached at init, soft-caps that bend the logits), and the perturbation that
moves biases and sinks away from their zero init the same way at any layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megalite.errors import ConfigError
from megalite.layers.init import full_normal
from megalite.moe.config import MoEConfig
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg

SEQ = 16


def gpt_oss_cfg(**overrides: object) -> Any:
    """Alternating sliding (W = 4) and full layers, sinks, q/k/v/o biases, a MoE of clamped-SwiGLU experts with
    biases behind a biased mixtral router (gpt-oss's top-k softmax)."""
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden_size=32, router="mixtral", aux_loss=0.01, router_bias=True)
    base: dict[str, object] = dict(num_layers=4, hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=8, seq_len=SEQ,
                                   layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                   attn_sinks=True, attn_bias=True, mlp="clamped_swiglu", swiglu_limit=0.3,
                                   mlp_bias=True, rope_theta=150000.0, moe=moe)
    return tiny_model_cfg("llama", **{**base, **overrides})


def gemma3_cfg(**overrides: object) -> Any:
    """5 local (W = 4, RoPE base 10k) : 1 global (base 1M) layers, q/k norm, sandwich norms, GeGLU, embeddings x
    sqrt(h), query_pre_attn_scalar apart from head_dim, attention and final soft-caps low enough to bend."""
    base: dict[str, object] = dict(num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, seq_len=SEQ,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=4,
                                   rope_theta=1e6, rope_local_theta=10000.0, qk_norm=True, sandwich_norm=True,
                                   mlp="geglu", embed_scale=True, query_pre_attn_scalar=10.0, attn_softcap=0.5,
                                   final_softcap=2.0, tie_embeddings=True, norm_eps=1e-6)
    return tiny_model_cfg("llama", **{**base, **overrides})


def gated_cfg(**overrides: object) -> Any:
    """Qwen3-Next-like attention: a per-element output gate, RoPE on a quarter of each head, one NoPE layer."""
    base: dict[str, object] = dict(num_layers=2, head_dim=8, seq_len=SEQ, attn_output_gate="element",
                                   rope_fraction=0.25, nope_layers=[1])
    return tiny_model_cfg("llama", **{**base, **overrides})


def hybrid_cfg(**overrides: object) -> Any:
    """Qwen3.5-like: 3 Gated DeltaNet layers then 1 full-attention layer, value heads twice the key heads and widths
    unlike the attention's, a sequence of 40 (not a multiple of the recurrence's chunk of 64)."""
    base: dict[str, object] = dict(num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, seq_len=40,
                                   layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                                   attn_output_gate="element", rope_fraction=0.25)
    return tiny_model_cfg("llama", **{**base, **overrides})


def hybrid_moe_cfg(**overrides: object) -> Any:
    """`hybrid_cfg` with Qwen3.5-MoE's feed-forward: 4 routed experts (qwen3's softmax over all, top-2) and a
    shared expert in every layer."""
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden_size=16, shared_experts=1, router="qwen3", aux_loss=0.01)
    return hybrid_cfg(**{"moe": moe, **overrides})


def nemotron_cfg(**overrides: object) -> Any:
    """Nemotron-H-like ("M-M*-"): one-part layers (mamba, mlp, mamba, attention without RoPE, mlp), the squared-ReLU
    MLP, 4 Mamba2 heads in 2 groups of B/C (one per rank at tp2), a sequence of 40 (not a multiple of the chunk)."""
    base: dict[str, object] = dict(num_layers=5, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, seq_len=40,
                                   layer_types=["mamba", "mlp", "mamba", "attention", "mlp"], mamba_num_heads=4,
                                   mamba_head_dim=6, mamba_n_groups=2, mamba_state_size=8, mlp="relu2",
                                   rope_fraction=0.0)
    return tiny_model_cfg("llama", **{**base, **overrides})


def kimi_cfg(**overrides: object) -> Any:
    """Kimi-Linear-like: 3 Kimi Delta Attention layers then 1 full-attention layer without RoPE (Kimi Linear's full
    layers are NoPE; MLA there, grouped-query attention here), one head count and width for q, k and v."""
    base: dict[str, object] = dict(layer_types=["kimi_delta_attention"] * 3 + ["full_attention"], nope_layers=[3],
                                   linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                                   linear_value_head_dim=8, attn_output_gate="none", rope_fraction=1.0)
    return hybrid_cfg(**{**base, **overrides})


def perturb(model: nn.Module, state: ParallelState) -> None:
    """Add N(0, 0.5^2) to every bias and sink: drawn in full by name, then this rank's shard taken (tp parts of
    a column layout, the ep rows of an expert stack), so every layout holds the same numbers."""
    specs = named_param_specs(model, ConfigError)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("bias") or name.endswith("sinks")):
                continue
            spec = specs[name]
            if spec.layout.kind == "column":
                parts = list(spec.layout.parts)
                full = full_normal((sum(parts),), 0.5, 11, name)
                p.add_(torch.cat([c.chunk(state.tp, 0)[state.tp_rank] for c in full.split(parts)]))
                continue
            split = spec.grads.split_over
            n = state.size(split) if split else 1
            full = full_normal((p.shape[0] * n,) + tuple(p.shape[1:]), 0.5, 11, name)
            start = state.rank_in(split) * p.shape[0] if split else 0
            p.add_(full[start:start + p.shape[0]])
