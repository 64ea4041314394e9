"""The `[mla]` config section (multi-head latent attention, docs/mla.md) and its checks, which config validation
calls. Torch-free: the config layer and the cost model read it without building anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megalite.section import doc_field as _f


@dataclass
class MLAConfig:
    """DeepSeek-V2/V3's attention shapes, under transformers' DeepseekV3Config names (its q_lora_rank None is 0)."""

    kv_lora_rank: int = _f(0, "compressed key/value latent width d_c (DeepSeek-V3: 512); 0 = MLA off (plain attention)")
    q_lora_rank: int = _f(0, "compressed query latent width d_c' (DeepSeek-V3: 1536); 0 = a plain q projection")
    qk_rope_head_dim: int = _f(64, "per-head width of the decoupled RoPE part of q and k (k's is shared by all heads)")
    qk_nope_head_dim: int = _f(128, "per-head width of the q/k part without position (up-projected from the latent)")
    v_head_dim: int = _f(128, "per-head width of v (and of the attention output)")

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class _ModelFields(Protocol):
    """What the checks read of the model section."""

    @property
    def arch(self) -> str: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def head_dim(self) -> int: ...


def mla_problems(mla: MLAConfig, model: _ModelFields) -> list[str]:
    """One line per problem of `[mla]` against the model section (validation calls it with the resolved config)."""
    if mla.kv_lora_rank < 0 or mla.q_lora_rank < 0:
        return [f"mla.kv_lora_rank = {mla.kv_lora_rank} and mla.q_lora_rank = {mla.q_lora_rank} must be >= 0 "
                "(0 = off)"]
    if not mla.enabled:
        return [] if not mla.q_lora_rank else ["mla.q_lora_rank is set but mla.kv_lora_rank = 0 (MLA off): set "
                                               "mla.kv_lora_rank > 0 to use MLA, or leave q_lora_rank at 0"]
    out = []
    dims = {"qk_rope_head_dim": mla.qk_rope_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
            "v_head_dim": mla.v_head_dim}
    out += [f"mla.{k} = {v} must be >= 1" for k, v in dims.items() if v < 1]
    if mla.qk_rope_head_dim % 2:
        out.append(f"mla.qk_rope_head_dim = {mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if model.arch != "llama":
        out.append(f"MLA (mla.kv_lora_rank > 0) needs model.arch=llama (RMSNorm, RoPE), got {model.arch!r}")
    if model.num_kv_heads not in (0, model.num_heads):
        out.append(f"MLA gives every head its own key and value: model.num_kv_heads = {model.num_kv_heads} must be "
                   f"0 or num_heads = {model.num_heads}")
    if model.qk_norm or model.head_dim:
        out.append("model.qk_norm and model.head_dim do not apply to MLA (its head widths are mla.qk_nope_head_dim, "
                   "mla.qk_rope_head_dim and mla.v_head_dim): leave them unset")
    return out
