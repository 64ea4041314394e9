"""The mixer of a `mamba` layer (model.layer_types; Nemotron-H's "M"): Mamba2 (megalite/recurrent/mamba2.py) behind
the attention's call signature, as linear_mixer.py puts Gated DeltaNet. A mamba layer has no MLP (pattern.py).

RoPE does not apply (the conv and the decay carry position), so cos / sin are ignored. Packed documents: the block's
`DocumentIds` go to the layer, whose conv window and state restart at every document's first token. The recurrence
runs the chunked torch form whatever the model's kernels: the Triton chunk kernel takes the erasing gates only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megalite.context.documents import DocumentIds
from megalite.model.pattern import mamba_dims
from megalite.model.spec import ModelSpec, head_dim
from megalite.parallel.param_spec import ParamSpec, children_specs
from megalite.parallel.state import ParallelState
from megalite.recurrent.gated_deltanet import RecurrentCache
from megalite.recurrent.mamba2 import Mamba2, Mamba2Config


def mamba2_config(cfg: ModelSpec) -> Mamba2Config:
    """The layer's shape from the model.mamba_* fields; its norm's eps is the model's."""
    d = mamba_dims(cfg, head_dim(cfg))
    return Mamba2Config(cfg.hidden_size, d.heads, d.head_dim, d.groups, d.state_size, d.conv_kernel,
                        norm_eps=cfg.norm_eps, init_std=cfg.init_std, num_layers=cfg.num_layers)


class Mamba2Mixer(nn.Module):
    """forward(x, cos, sin, docs) -> [b, s, h] as `block.Attention`'s; `cached` for generation."""

    def __init__(self, cfg: ModelSpec, state: ParallelState, name: str, seed: int) -> None:
        super().__init__()
        self.mamba = Mamba2(mamba2_config(cfg), state, name=f"{name}.mamba", seed=seed)

    def param_specs(self) -> dict[str, ParamSpec]:
        return children_specs(self)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[DocumentIds] = None) -> torch.Tensor:
        return self.mamba(x, docs)

    def cached(self, x: torch.Tensor, cache: Optional[RecurrentCache]) -> tuple[torch.Tensor, RecurrentCache]:
        """Generation: the prompt from nothing (`cache` None), else the next tokens from `cache`."""
        return self.mamba.prefill(x) if cache is None else self.mamba.step(x, cache)
