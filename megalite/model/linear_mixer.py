"""The mixer of a recurrent layer (model.layer_types): linear_attention is Gated DeltaNet
(megalite/recurrent/gated_deltanet.py), kimi_delta_attention is Kimi Delta Attention (megalite/recurrent/kimi_delta.py),
behind the attention's call signature, so a block runs any of them the same way. Both read the model.linear_* fields
(Kimi Linear: linear_num_key_heads = linear_num_value_heads, one head width).

RoPE does not apply (the conv and the decay carry position), so cos / sin are ignored. Packed documents: the block's
`DocumentIds` go to the layer, whose conv window and recurrent state restart at every document's first token.
Context parallelism: the layer passes states between the zigzag chunks the model's cp split gives every block
(megalite/recurrent/state_passing.py), whatever the full layers' cp mode; its `full` document ids place every
document start, on any rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megalite.context.documents import DocumentIds
from megalite.model.ops import Ops
from megalite.model.pattern import KIMI_DELTA, LINEAR, linear_dims
from megalite.model.spec import ModelSpec, head_dim
from megalite.parallel.param_spec import ParamSpec, children_specs
from megalite.parallel.state import ParallelState
from megalite.recurrent.delta_layer import DeltaLayerConfig, RecurrentCache, ShortConvDeltaRule
from megalite.recurrent.gated_deltanet import GatedDeltaNet
from megalite.recurrent.kimi_delta import KimiDeltaAttention

# Each kind's layer class and the attribute it lives under (its parameters' names: layers.i.attn.gdn.*, .kda.*)
LAYERS: dict[str, tuple[str, type[ShortConvDeltaRule]]] = {LINEAR: ("gdn", GatedDeltaNet),
                                                          KIMI_DELTA: ("kda", KimiDeltaAttention)}


def delta_layer_config(cfg: ModelSpec, ops: Ops) -> DeltaLayerConfig:
    """The layer's shape from the model.linear_* fields; the Triton chunk kernel where the model runs Triton."""
    d = linear_dims(cfg, head_dim(cfg))
    return DeltaLayerConfig(cfg.hidden_size, d.key_heads, d.value_heads, d.key_head_dim, d.value_head_dim,
                            d.conv_kernel, norm_eps=cfg.norm_eps, init_std=cfg.init_std, num_layers=cfg.num_layers,
                            backend="triton" if ops.block_backend == "triton" else "chunked")


class LinearMixer(nn.Module):
    """forward(x, cos, sin, docs) -> [b, s, h] as `block.Attention`'s; `prefill` / `step` for generation."""

    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, name: str, seed: int,
                 kind: str = LINEAR) -> None:
        super().__init__()
        self.kind, (attr, cls) = kind, LAYERS[kind]
        self.add_module(attr, cls(delta_layer_config(cfg, ops), state, name=f"{name}.{attr}", seed=seed))

    @property
    def rule(self) -> ShortConvDeltaRule:
        """The recurrent layer, whatever its kind."""
        layer = getattr(self, LAYERS[self.kind][0])
        assert isinstance(layer, ShortConvDeltaRule)
        return layer

    def param_specs(self) -> dict[str, ParamSpec]:
        return children_specs(self)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[DocumentIds] = None) -> torch.Tensor:
        return self.rule(x, docs)

    def cached(self, x: torch.Tensor, cache: Optional[RecurrentCache]) -> tuple[torch.Tensor, RecurrentCache]:
        """Generation: the prompt from nothing (`cache` None), else the next tokens from `cache`."""
        return self.rule.prefill(x) if cache is None else self.rule.step(x, cache)
