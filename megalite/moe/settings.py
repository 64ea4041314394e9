"""The MoE part of a model config, read once: which layers are MoE and how they route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoESettings:
    experts: int
    top_k: int
    ffn: int               # each routed expert's width
    shared: int            # shared experts (fused into one MLP of width shared * shared_ffn)
    shared_ffn: int
    first_dense: int
    every: int
    router: str            # mixtral | qwen3 | deepseek
    renorm: bool
    route_scale: float
    groups: int
    group_top_k: int
    bias_rate: float
    aux_loss: float
    z_loss: float
    capacity_factor: float | None
    seq_aux_loss: float = 0.0  # DeepSeek-V3's sequence-wise balance loss coefficient (alpha)

    @classmethod
    def from_model(cls, m: Any) -> MoESettings | None:
        """None for a dense model (`moe_experts` = 0)."""
        if not getattr(m, "moe_experts", 0):
            return None
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        return cls(m.moe_experts, m.moe_top_k, ffn, m.moe_shared_experts, m.moe_shared_ffn_hidden_size or ffn,
                   m.moe_first_dense, m.moe_every, m.moe_router, m.moe_renorm, m.moe_route_scale, m.moe_groups,
                   m.moe_group_top_k, m.moe_bias_rate, m.moe_aux_loss, m.moe_z_loss, m.moe_capacity_factor,
                   m.moe_seq_aux_loss)

    def is_moe_layer(self, index: int) -> bool:
        """Layers first_dense, first_dense + every, ... are MoE (global layer indices)."""
        return index >= self.first_dense and (index - self.first_dense) % self.every == 0


def moe_layers(m: Any) -> list[int]:
    """The global indices of the MoE layers of model config `m` (empty for a dense model)."""
    s = MoESettings.from_model(m)
    return [] if s is None else [i for i in range(m.num_layers) if s.is_moe_layer(i)]
