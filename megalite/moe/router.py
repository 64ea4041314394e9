"""Routers: which experts each token goes to and with what weight. A function of the token and the
router's weights (and DeepSeek's bias) only, never of the layout: tokens are routed one by one.

  mixtral   top-k of the logits, softmax over those k (Jiang et al. 2024)
  qwen3     softmax over all experts, top-k, optionally renormalised to sum to 1 (Qwen3-MoE)
  deepseek  sigmoid scores; the top-k is chosen on score + bias (the auxiliary-loss-free balancing bias,
            `e_score_correction_bias` in the hub layout: no gradient, moved after each optimizer step by
            `balance.update_router_biases`), optionally within the best `group_top_k` of `groups` expert groups
            (group score: the sum of its two best biased scores; the other groups' experts are -inf); the weights
            are the chosen *scores* (without the bias), normalised if `renorm` and times `route_scale`
            (DeepSeek-V3, Liu et al. 2024, section 2.1.2; equal to transformers' DeepseekV3TopkRouter:
            tests/test_deepseek_router.py)

The logits are computed in fp32 (the routing decisions of a bf16 model must not flip on round-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from megalite.layers.init import full_normal
from megalite.moe.config import MoEConfig
from megalite.parallel.param_spec import REPLICATED, ParamSpec


@dataclass
class Routing:
    experts: torch.Tensor   # [T, k] int64 expert ids
    weights: torch.Tensor   # [T, k] fp32 combine weights (differentiable)
    probs: torch.Tensor     # [T, E] fp32 the distribution the load-balancing loss reads
    logits: torch.Tensor    # [T, E] fp32 (the z-loss reads their log-sum-exp)


class Router(nn.Module):
    def __init__(self, hidden: int, s: MoEConfig, sp: bool, name: str, seed: int, std: float) -> None:
        super().__init__()
        self.s, self.sp = s, sp
        self.weight = nn.Parameter(full_normal((s.experts, hidden), std, seed, f"{name}.weight"))
        # DeepSeek's balancing bias: a buffer (no gradient), saved with the model.
        self.bias: torch.Tensor
        self.register_buffer("bias", torch.zeros(s.experts), persistent=True)
        # gpt-oss's learned router bias (`moe.router_bias`; the hub's router.bias), added to the logits.
        self.logit_bias = nn.Parameter(torch.zeros(s.experts)) if s.router_bias else None

    def param_specs(self) -> dict[str, ParamSpec]:
        # Replicated over TP; under SP each TP rank routes its own 1/tp of the tokens: partial gradient sums.
        spec = ParamSpec(REPLICATED, sp_partial=self.sp)
        return {"weight": spec} if self.logit_bias is None else {"weight": spec, "logit_bias": spec}

    def forward(self, x: torch.Tensor) -> Routing:
        logits = x.float() @ self.weight.float().t()
        if self.logit_bias is not None:
            logits = logits + self.logit_bias.float()
        s = self.s
        if s.router == "mixtral":
            top, idx = logits.topk(s.top_k, dim=-1)
            return Routing(idx, top.softmax(dim=-1), logits.softmax(dim=-1), logits)
        if s.router == "qwen3":
            probs = logits.softmax(dim=-1)
            top, idx = probs.topk(s.top_k, dim=-1)
            if s.renorm:
                top = top / top.sum(dim=-1, keepdim=True)
            return Routing(idx, top, probs, logits)
        if s.router == "deepseek":
            scores = logits.sigmoid()
            choice = scores.detach() + self.bias.float()
            if s.groups > 1:
                choice = _group_limited(choice, s.groups, s.group_top_k)
            idx = choice.topk(s.top_k, dim=-1).indices
            top = scores.gather(1, idx)
            if s.renorm:
                top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
            return Routing(idx, top * s.route_scale, scores / scores.sum(dim=-1, keepdim=True), logits)
        raise ValueError(f"moe.router={s.router!r}: expected mixtral, qwen3 or deepseek")


def _group_limited(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """`choice` with the experts outside each token's `keep` best groups set to -inf."""
    t, e = choice.shape
    g = choice.view(t, groups, e // groups)
    group_score = g.topk(min(2, e // groups), dim=-1).values.sum(dim=-1)
    best = group_score.topk(keep, dim=-1).indices
    mask = torch.zeros(t, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return g.masked_fill(~mask[..., None], float("-inf")).view(t, e)
