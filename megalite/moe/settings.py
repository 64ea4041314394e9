"""The `[moe]` section of a model, read once: which layers are MoE and how they route (`MoEConfig` with the
widths that default to the model's filled in)."""

from __future__ import annotations

from typing import Any, Protocol

from megalite.moe.config import MoEConfig


class HasMoE(Protocol):
    """The part of a model spec (`megalite.model.spec.ModelSpec`) these helpers read."""

    @property
    def num_layers(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def moe(self) -> MoEConfig: ...


def moe_settings(m: HasMoE) -> MoEConfig | None:
    """The resolved `[moe]` section of model `m`; None for a dense model (`moe.experts` = 0)."""
    return m.moe.resolved(m.ffn_hidden_size)


def moe_layers(m: HasMoE | Any) -> list[int]:
    """The global indices of the MoE layers of model `m` (empty for a dense model); `Any`: a GPT chunk's `cfg`."""
    return m.moe.layers(m.num_layers)
