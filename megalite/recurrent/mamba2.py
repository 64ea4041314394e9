"""Mamba2's SSD layer (Dao & Gu, arXiv 2405.21060), the Mamba layer of Nemotron-H, on the gated delta-rule engine.

Per token x [h] (transformers' NemotronHMamba2Mixer, parameter for parameter; I = H P inner width, G groups of B/C,
N the state size):
    z, x, B, C, dt = in_proj(x)           [I], [I], [G N], [G N], [H]
    x, B, C = silu(conv(x, B, C) + conv_bias)     the causal depthwise conv (kernel 4), restarted at every document
    dt = clamp(softplus(dt + dt_bias), dt_limit)  the step, per head
    y = SSD(x, dt, A = -exp(A_log), B, C) + D x   per head h [P], its group's B, C [N]
    out = out_proj(GroupRMSNorm(y * silu(z)) * norm_weight)   the norm over each group's I / G channels

SSD is the engine's recurrence (megalite/recurrent/recurrence.py) with the `MAMBA2_SSD` gate: per head, a state
S [N, P] with S <- exp(dt A) S + B (dt x)^T and y = S^T C, i.e. q = C, k = B, v = x, beta = dt, g = dt A and
erase=False, scale 1; the key heads are the groups (head h reads group h // (H / G), transformers'
`repeat_interleave`). The recurrence runs on the chunked torch form: the Triton chunk kernel takes the GDN gate
only (engine.py refuses erase=False there).

Tensor parallelism splits the groups with their heads (G must be divisible by tp): in_proj is column-parallel
with each of its five parts split on its own, so rank r holds groups [r G/tp, ...) and the heads that read them;
the conv channels and bias, A_log, dt_bias, D and norm_weight are split with them; out_proj is row-parallel (one
all-reduce, or reduce-scatter under SP). Nothing is replicated: each norm group lies whole on one rank. Weights
are drawn whole from (seed, name) and sliced (megalite/recurrent/layer_init.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.context.documents import DocumentIds
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.param_spec import ParamSpec, children_specs, column
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from megalite.recurrent.conv import causal_conv
from megalite.recurrent.engine import Backend, gated_delta
from megalite.recurrent.gated_deltanet import RecurrentCache
from megalite.recurrent.layer_init import conv_init, decay_init, shard_parts
from megalite.recurrent.recurrence import MAMBA2_SSD, RuleInputs

Tensor = torch.Tensor


@dataclass(frozen=True)
class Mamba2Config:
    """The layer's shape (transformers' NemotronH mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size,
    conv_kernel, use_conv_bias, time_step_limit, layer_norm_epsilon) and how it runs."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int = 4
    conv_bias: bool = True
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    norm_eps: float = 1e-5
    init_std: float = 0.02
    num_layers: int = 1          # the residual-branch output's init std is init_std / sqrt(2 num_layers)
    backend: Backend = "chunked"
    chunk_size: int = CHUNK

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_dim(self) -> int:
        return self.num_groups * self.state_size

    def check(self, tp: int) -> None:
        """One line naming what cannot be built."""
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba_num_heads={self.num_heads} must be a multiple of n_groups={self.num_groups}")
        if self.num_groups % tp:
            raise ValueError(f"n_groups={self.num_groups} must be divisible by tp={tp} (each rank keeps whole groups "
                             "of B/C with the heads that read them)")
        if self.backend == "triton":
            raise ValueError("the Triton chunk kernel runs the erasing gates only: run Mamba2 with backend='chunked'")


def gated_group_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """RMSNorm(y * silu(gate)) over each of `groups` equal slices of the last dim, times weight; in fp32, back in
    y's dtype (transformers' NemotronHRMSNormGated: the gate before the norm, Mamba2's norm_before_gate=False)."""
    h = y.float() * F.silu(gate.float())
    h = h.unflatten(-1, (groups, -1))
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return weight * h.to(y.dtype)


class Mamba2(nn.Module):
    """forward(x [b, s, h], docs) -> [b, s, h] (s this rank's tokens under SP); `prefill` and `step` carry a
    `RecurrentCache` (conv window, state [b, H, N, P]). Parameter names: in_proj (z, x, B, C, dt fused),
    conv_weight [C, W], conv_bias, A_log, dt_bias, D, norm_weight, out_proj."""

    def __init__(self, cfg: Mamba2Config, state: ParallelState, *, name: str, seed: int) -> None:
        super().__init__()
        cfg.check(state.tp)
        tp, rank = state.tp, state.tp_rank
        self.cfg, self.state = cfg, state
        self.local_heads, self.local_groups = cfg.num_heads // tp, cfg.num_groups // tp
        i, gn, nh = cfg.inner, cfg.group_dim, cfg.num_heads
        self.conv_parts = [i, gn, gn]
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [i, i, gn, gn, nh], state, name=f"{name}.in_proj",
                                            seed=seed, std=cfg.init_std)
        channels, width = i + 2 * gn, cfg.conv_kernel
        self.conv_weight = nn.Parameter(shard_parts(conv_init((channels, width), width, seed, f"{name}.conv_weight"),
                                                    self.conv_parts, tp, rank))
        self.conv_bias = (nn.Parameter(shard_parts(conv_init((channels,), width, seed, f"{name}.conv_bias"),
                                                   self.conv_parts, tp, rank)) if cfg.conv_bias else None)
        a_log, dt_bias = decay_init(nh, seed, name)
        self.A_log = nn.Parameter(shard_parts(a_log, [nh], tp, rank))
        self.dt_bias = nn.Parameter(shard_parts(dt_bias, [nh], tp, rank))
        self.D = nn.Parameter(torch.ones(self.local_heads))
        self.norm_weight = nn.Parameter(torch.ones(i // tp))
        self.out_proj = RowParallelLinear(i, cfg.hidden_size, state, name=f"{name}.out_proj", seed=seed,
                                          std=cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def param_specs(self) -> dict[str, ParamSpec]:
        heads = ParamSpec(column([self.cfg.num_heads]))
        conv = ParamSpec(column(self.conv_parts), matrix=False)
        specs = children_specs(self) | {"conv_weight": conv, "A_log": heads, "dt_bias": heads, "D": heads,
                                        "norm_weight": ParamSpec(column([self.cfg.inner]))}
        return specs | ({"conv_bias": conv} if self.conv_bias is not None else {})

    def forward(self, x: Tensor, docs: Optional[DocumentIds] = None) -> Tensor:
        if self.state.cp > 1:
            raise ValueError("Mamba2 layers under context parallelism are not supported yet: set parallel.cp=1")
        return self._mix(x, None if docs is None else docs.full, None, self.cfg.backend)[0]

    def prefill(self, x: Tensor) -> tuple[Tensor, RecurrentCache]:
        """The forward of a prompt (one document per row) and the cache the next token starts from."""
        return self._mix(x, None, None, self.cfg.backend)

    def step(self, x: Tensor, cache: RecurrentCache) -> tuple[Tensor, RecurrentCache]:
        """The next token(s) x [b, t, h] from `cache`: constant work and memory per token."""
        return self._mix(x, None, cache, "recurrent")

    def _mix(self, x: Tensor, doc_ids: Optional[Tensor], cache: Optional[RecurrentCache], backend: Backend
             ) -> tuple[Tensor, RecurrentCache]:
        cfg, tp = self.cfg, self.state.tp
        z, xs, b, c, dt = self.in_proj(x)                           # each [bsz, S, part / tp], S the whole sequence
        bsz, seq = z.shape[:2]
        mixed, conv_state = causal_conv(torch.cat([xs, b, c], dim=-1), self.conv_weight, doc_ids,
                                        None if cache is None else cache.conv)
        if self.conv_bias is not None:
            mixed = mixed + self.conv_bias.to(mixed.dtype)
        xs, b, c = F.silu(mixed).split([p // tp for p in self.conv_parts], dim=-1)
        xs = xs.reshape(bsz, seq, self.local_heads, cfg.head_dim)
        step = F.softplus(dt.float() + self.dt_bias).clamp(*cfg.dt_limit)              # [bsz, S, H_local]
        rule = RuleInputs(q=c.reshape(bsz, seq, self.local_groups, cfg.state_size),
                          k=b.reshape(bsz, seq, self.local_groups, cfg.state_size), v=xs,
                          g=-self.A_log.float().exp() * step, beta=step)
        y, ssm = gated_delta(rule, doc_ids=doc_ids, scale=1.0, erase=MAMBA2_SSD.erase, backend=backend,
                             initial_state=None if cache is None else cache.state, chunk_size=cfg.chunk_size)
        y = y + self.D.to(y.dtype)[:, None] * xs                    # the skip, per head
        y = gated_group_rms_norm(y.reshape(bsz, seq, -1), z, self.norm_weight, self.local_groups, cfg.norm_eps)
        return self.out_proj(y.to(x.dtype)), RecurrentCache(conv_state, ssm)
