"""The MLP's activation, for the dense MLP and the MoE experts alike: which one (`model.mlp`) and its math.

  swiglu          silu(gate) * up (Llama; Shazeer 2020)
  geglu           gelu_tanh(gate) * up (Gemma; transformers' gelu_pytorch_tanh)
  clamped_swiglu  gate' = min(gate, limit), up' = clamp(up, -limit, limit), (up' + 1) * gate' * sigmoid(alpha gate')
                  (gpt-oss, alpha 1.702, limit 7: transformers' GptOssExperts._apply_gate)
  gelu            gelu_tanh(x), not gated (GPT-2)
  relu2           relu(x)^2, not gated (Primer, So et al. 2021; Nemotron-H: transformers' "relu2")

The gated kinds take [gate, up] from one fused column linear (gate rows first, then up rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch


UNGATED = ("gelu", "relu2")  # the kinds that take one up projection


class Activations(Protocol):
    """What the activations use of the model's op backend (`megalite.model.ops.Ops` has it): the fused kernels."""

    @property
    def swiglu(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]: ...
    @property
    def gelu_tanh(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


@dataclass(frozen=True)
class MLPActivation:
    kind: str = "swiglu"  # swiglu | geglu | clamped_swiglu | gelu | relu2
    alpha: float = 1.702  # clamped_swiglu
    limit: float = 7.0    # clamped_swiglu

    @property
    def gated(self) -> bool:
        """Takes a gate and an up projection (the fused linear is 2F wide)."""
        return self.kind not in UNGATED

    def __call__(self, ops: Activations, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.kind == "swiglu":
            return ops.swiglu(parts[0], parts[1])
        if self.kind == "geglu":
            return ops.gelu_tanh(parts[0]) * parts[1]
        if self.kind == "clamped_swiglu":
            gate, up = parts[0].clamp(max=self.limit), parts[1].clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.kind == "gelu":
            return ops.gelu_tanh(parts[0])
        if self.kind == "relu2":
            return torch.relu(parts[0]).square()
        raise ValueError(f"model.mlp={self.kind!r}: expected swiglu, geglu, clamped_swiglu, gelu or relu2")


SWIGLU, GELU = MLPActivation("swiglu"), MLPActivation("gelu")
