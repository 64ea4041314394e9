"""The routed experts of one MoE layer, this rank's share: experts [ep_rank * E/ep, (ep_rank + 1) * E/ep).

Weights are stacked per layer ([E/ep, 2F, H] gate and up fused for SwiGLU, [E/ep, F] GeLU up for gpt2;
[E/ep, H, F] down), the layout of transformers' fused experts, and each expert is drawn in full from its
global name (`layers.init`), so expert e has the same numbers at any ep. TP: experts are replicated over
the tp ranks (each computes the tokens it holds: all of them without SP, its 1/tp slice with SP, whence
`sp_partial`); expert-parallel over ep, their gradients reduced as `param_spec.EXPERT_PARALLEL` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from megalite.fp8.experts import Fp8ExpertGemm
from megalite.layers.activation import GELU, SWIGLU, Activations, MLPActivation
from megalite.layers.init import full_normal
from megalite.moe.grouped import expert_mm
from megalite.parallel.param_spec import EXPERT_PARALLEL, REPLICATED, MatrixStack, ParamSpec
from megalite.parallel.state import ParallelState


@dataclass(frozen=True)
class ExpertShape:
    """A MoE layer's routed experts: how many, their input width, FFN width and MLP kind (gated: SwiGLU, else GeLU,
    unless `activation` names another: `model.mlp`); `bias`: each expert's linears have biases (gpt-oss)."""

    num_experts: int
    hidden: int
    ffn: int
    gated: bool
    activation: MLPActivation | None = None
    bias: bool = False

    def act(self) -> MLPActivation:
        if self.activation is not None:
            return self.activation
        return SWIGLU if self.gated else GELU


class Experts(nn.Module):
    fp8: Fp8ExpertGemm | None = None  # set by `megalite.fp8.enable.enable_fp8`: the expert GEMMs in FP8

    def __init__(self, shape: ExpertShape, state: ParallelState, ops: Activations, name: str, seed: int, std: float,
                 num_layers: int) -> None:
        super().__init__()
        num_experts, hidden, ffn = shape.num_experts, shape.hidden, shape.ffn
        self.activation = shape.act()
        gated = self.activation.gated
        ep = state.size("ep")
        self.local = num_experts // ep
        first = state.rank_in("ep") * self.local
        self.gated, self.ops, self.sp = gated, ops, state.sp
        out_std = std / math.sqrt(2 * num_layers)  # scaled residual-branch init, as the dense MLP's down
        ups, downs = [], []
        for e in range(first, first + self.local):
            parts = ["gate", "up"] if gated else ["up"]
            ups.append(torch.cat([full_normal((ffn, hidden), std, seed, f"{name}.{e}.{p}") for p in parts]))
            downs.append(full_normal((hidden, ffn), out_std, seed, f"{name}.{e}.down"))
        self.up = nn.Parameter(torch.stack(ups))
        self.down = nn.Parameter(torch.stack(downs))
        # Per-expert biases (gpt-oss's gate_up_proj_bias / down_proj_bias), zero at init like the linears'.
        self.up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if shape.bias:
            self.up_bias = nn.Parameter(torch.zeros(self.local, self.up.shape[1]))
            self.down_bias = nn.Parameter(torch.zeros(self.local, hidden))

    def param_specs(self) -> dict[str, ParamSpec]:
        """Both weights are stacks of whole per-expert matrices (`MatrixStack`): an expert's up is its gate and
        up (or the GeLU up alone), its down one matrix."""
        hidden, ffn = self.down.shape[1], self.down.shape[2]

        def stack(rows: tuple[int, ...]) -> ParamSpec:
            return ParamSpec(REPLICATED, sp_partial=self.sp, grads=EXPERT_PARALLEL, stack=MatrixStack(rows))
        specs = {"up": stack((ffn, ffn) if self.gated else (ffn,)), "down": stack((hidden,))}
        if self.up_bias is not None:  # split over ep with the experts; no matrices (AdamW's, not Muon's)
            bias = ParamSpec(REPLICATED, sp_partial=self.sp, grads=EXPERT_PARALLEL)
            specs |= {"up_bias": bias, "down_bias": bias}
        return specs

    def _mm(self, x: torch.Tensor, weight: torch.Tensor, counts: list[int],
            sources: list[list[int]] | None) -> torch.Tensor:
        if self.fp8 is not None:  # quantized from the fp32 master weight
            return self.fp8.expert_mm(x, weight, counts, sources)
        return expert_mm(x, weight.to(x.dtype), counts)

    def forward(self, x: torch.Tensor, counts: list[int], sources: list[list[int]] | None = None) -> torch.Tensor:
        """x [N, H] sorted by local expert, counts[e] rows each (`sources[e]`: how many from each ep rank, in
        rank order; the FP8 GEMMs sum the weight gradient source by source) -> [N, H]."""
        h = self._add_bias(self._mm(x, self.up, counts, sources), self.up_bias, counts)
        h = self.activation(self.ops, h.chunk(2, dim=-1) if self.gated else [h])
        return self._add_bias(self._mm(h.contiguous(), self.down, counts, sources), self.down_bias, counts)

    @staticmethod
    def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
        """y [N, out] sorted by expert plus each row's expert's bias row (counts[e] rows of expert e)."""
        if bias is None:
            return y
        rows = torch.tensor(counts, device=y.device)
        return y + bias.to(y.dtype).repeat_interleave(rows, dim=0, output_size=y.shape[0])
