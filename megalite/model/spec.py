"""What the model reads of its configuration: a Protocol, so the model (a core layer) does not depend on the
config package above it. `megalite.config.ModelArgs` (the `[model]` and `[moe]` sections) satisfies it once
resolved (`config.derive`: vocab size from the tokenizer, num_kv_heads / ffn_hidden_size / tie_embeddings filled
in). Every field is read as is: configs written before a field existed are mapped when loaded
(`megalite.config.aliases`), not guessed here."""

from __future__ import annotations

from typing import Protocol

from megalite.mla.config import MLAConfig
from megalite.moe.config import MoEConfig
from megalite.mtp.config import MTPConfig


def head_dim(cfg: ModelSpec) -> int:
    """The attention head width: `head_dim` where a config sets it (model.head_dim, Qwen3), else hidden / heads."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_heads


class RopeFields(Protocol):
    """model.rope_scaling and its parameters (megalite/model/rope.py `RopeScaling.of`): the `[model]` section and
    every `ModelSpec` have them."""

    @property
    def rope_scaling(self) -> str: ...
    @property
    def rope_factor(self) -> float: ...
    @property
    def rope_original_max_positions(self) -> int: ...
    @property
    def rope_beta_fast(self) -> float: ...
    @property
    def rope_beta_slow(self) -> float: ...
    @property
    def rope_mscale(self) -> float: ...
    @property
    def rope_mscale_all_dim(self) -> float: ...
    @property
    def rope_low_freq_factor(self) -> float: ...
    @property
    def rope_high_freq_factor(self) -> float: ...
    @property
    def rope_truncate(self) -> bool: ...


class ModelSpec(RopeFields, Protocol):
    @property
    def arch(self) -> str: ...  # llama | gpt2
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def make_vocab_divisible_by(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def dropout(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool | None: ...
    @property
    def init_std(self) -> float: ...
    @property
    def kernels(self) -> str: ...  # auto | torch | triton
    @property
    def recompute(self) -> str: ...  # none | selective | full
    @property
    def qk_norm(self) -> bool: ...  # Qwen3's per-head RMSNorm of q and k
    @property
    def head_dim(self) -> int: ...  # 0 = hidden_size / num_heads
    # The layer pattern and the variants (megalite/model/pattern.py resolves them; docs/attention.md).
    @property
    def layer_types(self) -> list[str]: ...  # HF's layer_types names, one per layer or a period
    @property
    def sliding_window(self) -> int: ...  # W of sliding_attention layers
    @property
    def linear_num_key_heads(self) -> int: ...  # linear_attention layers (Gated DeltaNet); 0 = num_heads
    @property
    def linear_num_value_heads(self) -> int: ...  # 0 = linear_num_key_heads
    @property
    def linear_key_head_dim(self) -> int: ...  # 0 = head_dim
    @property
    def linear_value_head_dim(self) -> int: ...  # 0 = linear_key_head_dim
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def mamba_num_heads(self) -> int: ...  # mamba layers (Mamba2); 0 = num_heads
    @property
    def mamba_head_dim(self) -> int: ...  # 0 = head_dim
    @property
    def mamba_n_groups(self) -> int: ...  # groups sharing B and C
    @property
    def mamba_state_size(self) -> int: ...
    @property
    def mamba_conv_kernel(self) -> int: ...
    @property
    def rope_local_theta(self) -> float: ...  # sliding_attention layers' RoPE base; 0 = rope_theta
    @property
    def rope_fraction(self) -> float: ...  # share of each head's dims rotated (partial RoPE); 0 = NoPE
    @property
    def nope_layers(self) -> list[int]: ...  # layers with no RoPE
    @property
    def attn_sinks(self) -> bool: ...  # a learnable per-head logit in the softmax denominator (gpt-oss)
    @property
    def attn_output_gate(self) -> str: ...  # none | head | element (Qwen3-Next)
    @property
    def attn_softcap(self) -> float: ...  # 0 = off (Gemma 2)
    @property
    def final_softcap(self) -> float: ...  # 0 = off (Gemma 2)
    @property
    def query_pre_attn_scalar(self) -> float: ...  # 0 = head_dim (Gemma)
    @property
    def attn_bias(self) -> bool: ...  # q/k/v/o biases (gpt-oss)
    @property
    def sandwich_norm(self) -> bool: ...  # post-attention and post-MLP norms (Gemma 2/3)
    @property
    def embed_scale(self) -> bool: ...  # embeddings x sqrt(hidden) (Gemma)
    @property
    def mlp(self) -> str: ...  # auto | swiglu | geglu | clamped_swiglu | gelu
    @property
    def swiglu_limit(self) -> float: ...
    @property
    def swiglu_alpha(self) -> float: ...
    @property
    def mlp_bias(self) -> bool: ...  # dense MLP and expert biases (gpt-oss)
    @property
    def moe(self) -> MoEConfig: ...  # the [moe] section; experts = 0 is a dense model
    @property
    def mla(self) -> MLAConfig: ...  # the [mla] section; kv_lora_rank = 0 is plain attention
    @property
    def mtp(self) -> MTPConfig: ...  # the [mtp] section; num_layers = 0 is no multi-token prediction
