"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692), TP/SP-aware: the gated delta rule with a decay per key
channel, on the engine and the layer frame Gated DeltaNet uses (delta_layer.py).

Per token x [h] (transformers' KimiLinearDeltaAttention, parameter for parameter; r = the gates' low rank, K in
Kimi Linear):
    q, k, v, b = in_proj(x)            [Hk*K], [Hk*K], [H*V], [H]     (q_proj, k_proj, v_proj, b_proj fused)
    q, k, v = silu(conv(q, k, v))      the causal depthwise conv (kernel 4) over q, k, v, restarted per document
    q, k = l2norm(q), l2norm(k)        per key head
    beta = sigmoid(b)                  the write strength, per value head
    g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)    the log decay per value head and key channel [H, K]:
                                       f_a [r, h], f_b [H*K, r] (forget_gate.f_a_proj, f_b_proj), A_log [H],
                                       dt_bias [H*K]
    o = gated_delta(q, k, v, g, beta)  scale 1/sqrt(K)
    y = out_proj(RMSNorm(o) * norm_weight * sigmoid(g_b(g_a(x))))    the output gate low-rank too: g_a [r, h],
                                       g_b [H*V, r]; the gate's activation is a sigmoid (Gated DeltaNet's: silu)

Tensor parallelism: in_proj, f_b and g_b are column-parallel (split with the heads: rank r's f_b rows are its
value heads' K channels each), dt_bias and A_log with their heads; the low-rank down-projections f_a and g_a are
replicated (`ReplicatedLinear`: they feed every head), applied to the input made whole once, so each rank
back-propagates only its heads' share through them and their gradients are partial sums over TP (`sp_partial`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.layers.linear import ColumnParallelLinear, ReplicatedLinear, enter_tp_region
from megalite.parallel.param_spec import ParamSpec, column
from megalite.parallel.state import ParallelState
from megalite.recurrent.delta_layer import DeltaLayerConfig, Projected, ShortConvDeltaRule
from megalite.recurrent.layer_init import decay_init, shard_parts

Tensor = torch.Tensor


class KimiDeltaAttention(ShortConvDeltaRule):
    """forward(x [b, s, h], docs) -> [b, s, h]; `prefill` / `step` (delta_layer.py). Parameter names: in_proj (q,
    k, v, b fused), f_a, f_b, A_log, dt_bias (the forget gate), g_a, g_b (the output gate), conv_weight [C, W],
    norm_weight, out_proj."""

    out_activation = staticmethod(torch.sigmoid)  # RMSNorm(o) * w * sigmoid(g_b(g_a(x))), transformers' o_norm

    def __init__(self, cfg: DeltaLayerConfig, state: ParallelState, *, name: str, seed: int) -> None:
        super().__init__(cfg, state, name=name, seed=seed)
        kd, vd, nv, r, std = cfg.key_dim, cfg.value_dim, cfg.num_value_heads, cfg.rank, cfg.init_std
        self.channels = nv * cfg.key_head_dim               # the decay's: one per value head and key channel
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [kd, kd, vd, nv], state, name=f"{name}.in_proj",
                                            seed=seed, std=std, input_ready=True)
        self.f_a = ReplicatedLinear(cfg.hidden_size, r, state, name=f"{name}.f_a", seed=seed, std=std)
        self.f_b = ColumnParallelLinear(r, [self.channels], state, name=f"{name}.f_b", seed=seed, std=std,
                                        input_ready=True)
        self.g_a = ReplicatedLinear(cfg.hidden_size, r, state, name=f"{name}.g_a", seed=seed, std=std)
        self.g_b = ColumnParallelLinear(r, [vd], state, name=f"{name}.g_b", seed=seed, std=std, input_ready=True)
        a_log, _ = decay_init(nv, seed, name)
        _, dt_bias = decay_init(self.channels, seed, name)
        self.A_log = nn.Parameter(shard_parts(a_log, [nv], state.tp, state.tp_rank))
        self.dt_bias = nn.Parameter(shard_parts(dt_bias, [self.channels], state.tp, state.tp_rank))

    def param_specs(self) -> dict[str, ParamSpec]:
        return super().param_specs() | {"A_log": ParamSpec(column([self.cfg.num_value_heads])),
                                        "dt_bias": ParamSpec(column([self.channels]))}

    def _project(self, x: Tensor) -> Projected:
        x = enter_tp_region(x, self.state)                          # whole (SP: gathered) once, for every projection
        q, k, v, b = self.in_proj(x)                                # each [b, S, part / tp]
        bsz, seq = x.shape[:2]
        gate = self.f_b(self.f_a(x))[0].float() + self.dt_bias.float()
        gate = F.softplus(gate.view(bsz, seq, self.local_v_heads, self.cfg.key_head_dim))
        g = -self.A_log.float().exp()[:, None] * gate                # [b, S, H_local, K], <= 0
        return Projected(torch.cat([q, k, v], dim=-1), g, b.sigmoid(), self.g_b(self.g_a(x))[0])
