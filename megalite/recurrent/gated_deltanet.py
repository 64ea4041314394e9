"""Gated DeltaNet (Yang et al., arXiv 2412.06464), the linear layer of Qwen3.5 / Qwen3-Next, TP/SP-aware.

Per token x [h] (transformers' Qwen3_5GatedDeltaNet, parameter for parameter):
    q, k, v, z, b, a = in_proj(x)      [Hk*K], [Hk*K], [H*V], [H*V], [H], [H]   (in_proj_qkv, _z, _b, _a fused)
    q, k, v = silu(conv(q, k, v))      the causal depthwise conv (kernel 4), restarted at every document
    q, k = l2norm(q), l2norm(k)        per key head
    beta = sigmoid(b)                  the write strength, per value head
    g = -exp(A_log) * softplus(a + dt_bias)    the log decay, per value head (<= 0)
    o = gated_delta(q, k, v, g, beta)  scale 1/sqrt(K); value head j reads key head j // (H/Hk)
    y = out_proj(RMSNorm(o) * norm_weight * silu(z))     the norm per value head, over V

Everything after the projections (the conv, the rule, the norm, tensor and context parallelism, generation) is
delta_layer.py's, shared with Kimi Delta Attention. Under tensor parallelism in_proj is column-parallel with
each of its six parts split separately; A_log and dt_bias are split with their heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.layers.linear import ColumnParallelLinear
from megalite.parallel.param_spec import ParamSpec, column
from megalite.parallel.state import ParallelState
from megalite.recurrent.delta_layer import DeltaLayerConfig, Projected, RecurrentCache, ShortConvDeltaRule
from megalite.recurrent.layer_init import decay_init, shard_parts

Tensor = torch.Tensor
# The layer's shape: the fields every delta-rule layer shares (delta_layer.py).
GatedDeltaNetConfig = DeltaLayerConfig
__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "RecurrentCache"]


class GatedDeltaNet(ShortConvDeltaRule):
    """forward(x [b, s, h], docs) -> [b, s, h]; `prefill` / `step` (delta_layer.py). Parameter names: in_proj (q,
    k, v, z, b, a fused), conv_weight [C, W], A_log, dt_bias, norm_weight, out_proj."""

    out_activation = staticmethod(F.silu)         # RMSNorm(o) * w * silu(z)

    def __init__(self, cfg: DeltaLayerConfig, state: ParallelState, *, name: str, seed: int) -> None:
        super().__init__(cfg, state, name=name, seed=seed)
        kd, vd, nv = cfg.key_dim, cfg.value_dim, cfg.num_value_heads
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [kd, kd, vd, vd, nv, nv], state, name=f"{name}.in_proj",
                                            seed=seed, std=cfg.init_std)
        a_log, dt_bias = decay_init(nv, seed, name)
        self.A_log = nn.Parameter(shard_parts(a_log, [nv], state.tp, state.tp_rank))
        self.dt_bias = nn.Parameter(shard_parts(dt_bias, [nv], state.tp, state.tp_rank))

    def param_specs(self) -> dict[str, ParamSpec]:
        heads = ParamSpec(column([self.cfg.num_value_heads]))
        return super().param_specs() | {"A_log": heads, "dt_bias": heads}

    def _project(self, x: Tensor) -> Projected:
        q, k, v, z, b, a = self.in_proj(x)                          # each [b, S, part / tp], S the whole sequence
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return Projected(torch.cat([q, k, v], dim=-1), g, b.sigmoid(), z)
