"""The MoE feed-forward of a block: route, dispatch, experts, combine, plus optional shared experts.

x [B, S', H] (S' = S/tp under SP, S/cp under CP): each token is routed on its own, so the layer works
on whatever tokens this rank holds. Without SP the tp ranks hold the same tokens and compute the same
thing (experts replicated over tp, no tp communication); with SP each routes its own slice. Shared
experts (DeepSeek) are one dense MLP of width shared x shared_ffn, tensor-parallel like the dense MLP; with
moe.shared_gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) their output is scaled per token by sigmoid(x . w), the
gate w [1, h] replicated over tp like the router (under SP each rank gates its own tokens: a partial gradient).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from megalite.layers.activation import MLPActivation
from megalite.layers.init import full_normal
from megalite.moe.config import MoEConfig
from megalite.moe.dispatch import combine, dispatch
from megalite.moe.experts import Activations, Experts, ExpertShape
from megalite.moe.losses import AuxScale, LossCoefficients, attach, router_losses
from megalite.moe.router import Router, Routing
from megalite.moe.stats import LayerStats
from megalite.parallel import comm
from megalite.parallel.param_spec import REPLICATED, ParamSpec
from megalite.parallel.state import ParallelState

# `model.compile` (megalite/model/compile.py) compiles the block around this layer, not the layer itself: its
# shapes follow the router's choices (the rows per expert and per ep rank are read to Python lists, every
# micro-batch, for the grouped GEMM's splits and the all-to-all's sizes; the router losses' values are floats for
# metrics.jsonl), so a graph would hold them as constants and recompile at every new routing. It runs eagerly
# between the block's graphs: one documented graph break per MoE block (docs/performance.md, docs/moe.md).
ROUTED_SHAPES = "the MoE layer's shapes follow the router's choices (read to Python every micro-batch)"


def _eager_under_compile(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return comm.outside_graph(forward, ROUTED_SHAPES)


@dataclass(frozen=True)
class MoEContext:
    """What a block needs to build a MoE FFN: the resolved `[moe]` section (`MoEConfig.resolved`), the model's shared
    aux-loss scale, the MoE layer count; the experts' activation (`model.mlp`; None: the arch's) and whether they
    have biases (`model.mlp_bias`)."""

    settings: MoEConfig
    aux_scale: AuxScale
    num_layers: int
    activation: MLPActivation | None = None
    expert_bias: bool = False


class SharedGate(nn.Module):
    """sigmoid(x . w) per token, w [1, h] drawn whole from (seed, name): transformers' `shared_expert_gate`, a
    bias-free Linear(h, 1), in fp32 as the router's logits."""

    def __init__(self, hidden: int, sp: bool, name: str, seed: int, std: float) -> None:
        super().__init__()
        self.sp = sp
        self.weight = nn.Parameter(full_normal((1, hidden), std, seed, f"{name}.weight"))

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec(REPLICATED, sp_partial=self.sp)}  # as the router's: partial sums under SP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x.float() @ self.weight.float().t())


class MoELayer(nn.Module):
    def __init__(self, cfg, moe: MoEContext, state: ParallelState, ops: Activations, name: str, seed: int,
                 mlp_cls: type[nn.Module]) -> None:
        super().__init__()
        s = moe.settings
        self.s, self.state, self.aux_scale = s, state, moe.aux_scale
        n = max(1, moe.num_layers)  # each loss is averaged over the model's MoE layers
        self.coef = LossCoefficients(s.aux_loss / n, s.seq_aux_loss / n, s.z_loss / n, s.top_k)
        self.router = Router(cfg.hidden_size, s, state.sp, f"{name}.router", seed, cfg.init_std)
        shape = ExpertShape(s.experts, cfg.hidden_size, s.ffn_hidden_size, cfg.arch == "llama", moe.activation,
                            moe.expert_bias)
        self.experts = Experts(shape, state, ops, f"{name}.experts", seed, cfg.init_std, cfg.num_layers)
        self.shared: nn.Module | None = None
        if s.shared_experts:
            shared_cfg = copy.copy(cfg)  # the model config with the shared experts' fused width
            shared_cfg.ffn_hidden_size = s.shared_experts * s.shared_ffn_hidden_size
            self.shared = mlp_cls(shared_cfg, state, ops, f"{name}.shared", seed)
        self.shared_gate = SharedGate(cfg.hidden_size, state.sp, f"{name}.shared_gate", seed, cfg.init_std) \
            if s.shared_experts and s.shared_gate else None
        self.stats = LayerStats(s.experts)

    @_eager_under_compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s_, h = x.shape
        flat = x.reshape(-1, h)
        routing = self.router(flat)
        rows, plan = dispatch(flat, routing.experts, self.s.experts, self.state, self.s.capacity_factor)
        if self.state.size("ep") > 1:
            me = self.state.rank_in("ep")
            self.stats.record_exchange(sum(plan.send) - plan.send[me] + sum(plan.recv) - plan.recv[me])
        y = self.experts(rows, plan.local_counts, plan.sources)
        y = combine(y, plan, routing.weights, flat.shape[0], self.state)
        out = y.view(b, s_, h).to(x.dtype)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(x).to(shared.dtype)
            out = out + shared
        if torch.is_grad_enabled() and self.training:
            out = self._losses(out, routing, b, plan.dropped)
        return out

    def _losses(self, out: torch.Tensor, routing: Routing, sequences: int, dropped: int) -> torch.Tensor:
        losses = router_losses(routing.experts, routing.probs, routing.logits, sequences, self.coef, self.state)
        self.stats.record(losses, dropped)
        return out if losses.share is None else attach(out, losses.share, self.aux_scale.value)


def moe_layers_of(chunks: list[nn.Module]) -> list[tuple[str, MoELayer]]:
    """(global layer name, MoELayer) of every MoE layer on this rank, in model order."""
    out: list[tuple[str, MoELayer]] = []
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, MoELayer):
                out.append((name.removeprefix("0.").removesuffix(".mlp"), m))
    return out
