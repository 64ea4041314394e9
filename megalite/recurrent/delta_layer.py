"""What the delta-rule layers share (Gated DeltaNet, gated_deltanet.py; Kimi Delta Attention, kimi_delta.py): a
short causal conv over q, k, v, the gated delta rule, a gated RMSNorm per head and the output projection, tensor-
and context-parallel, with generation from a constant-size cache. A layer says only how it projects a token
(`_project`: the conv's input, the log decay g, beta and the output gate); everything after is here:

    q, k, v = silu(conv(conv_in))      the causal depthwise conv (kernel W), restarted at every document
    q, k = l2norm(q), l2norm(k)        per key head
    o = gated_delta(q, k, v, g, beta)  scale 1/sqrt(K); value head j reads key head j // (H/Hk)
    y = out_proj(RMSNorm(o) * norm_weight * act(out_gate))      the norm per value head, over V

Under tensor parallelism the heads are split (Megatron-LM section 3, as the attention's): the projections are
column-parallel with each logical part split separately, so rank r holds key heads [r Hk/tp, ...) and the value
heads [r H/tp, ...) that read them (H/Hk consecutive value heads per key head); the conv's channels and the decay
parameters are split with their heads; out_proj is row-parallel (one all-reduce, or reduce-scatter under SP, at
the exit). Replicated: norm_weight ([V], shared by every head): each rank back-propagates only its heads' share,
so its gradient is a partial sum over TP (`sp_partial`, all-reduced there, like Qwen3's q/k norms). Under SP the
column layers' all-gather gives every rank the whole sequence, which the conv and the recurrence need anyway.
Under context parallelism (megalite's zigzag split: two slices per rank) the conv's window reaches into the
previous slice (its last W-1 inputs, all-gathered) and the recurrence passes states (state_passing.py). Every
weight is drawn whole from (seed, name) and then sliced: every layout starts equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.context.documents import DocumentIds
from megalite.layers.linear import RowParallelLinear
from megalite.parallel.param_spec import REPLICATED, ParamSpec, children_specs, column
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from megalite.recurrent.conv import causal_conv, gated_rms_norm, l2_normalize
from megalite.recurrent.engine import Backend, gated_delta
from megalite.recurrent.layer_init import conv_init, shard_parts
from megalite.recurrent.recurrence import RuleInputs
from megalite.recurrent.state_passing import gather_slices, joined, owned_slices, state_passing_gated_delta

Tensor = torch.Tensor


@dataclass(frozen=True)
class DeltaLayerConfig:
    """The layer's shape (transformers' linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim, rms_norm_eps; Kimi's linear_num_heads and linear_head_dim
    are key heads = value heads and K = V) and how it runs."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    init_std: float = 0.02
    num_layers: int = 1          # the residual-branch output's init std is init_std / sqrt(2 num_layers)
    backend: Backend = "chunked"
    chunk_size: int = CHUNK
    gate_rank: int = 0           # Kimi Delta Attention's low-rank gate projections; 0 = key_head_dim (Kimi's)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def rank(self) -> int:
        return self.gate_rank or self.key_head_dim

    def check(self, tp: int) -> None:
        """One line naming what cannot be built."""
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads={self.num_value_heads} must be a multiple of "
                             f"num_key_heads={self.num_key_heads}")
        if self.num_key_heads % tp:
            raise ValueError(f"num_key_heads={self.num_key_heads} must be divisible by tp={tp} (each rank keeps "
                             "whole key heads with the value heads that read them)")


@dataclass(frozen=True)
class RecurrentCache:
    """A linear layer's generation state, constant in size per token: the last W-1 conv inputs [B, W-1, C_local]
    and the recurrent state [B, H_local, K, V]."""

    conv: Tensor
    state: Tensor


@dataclass(frozen=True)
class Projected:
    """A layer's projections of its input, this rank's heads over the whole sequence S: the conv's input
    conv_in [b, S, C_local] (q, k, v), the log decay g [b, S, H_local] or [b, S, H_local, K] (<= 0), the write
    strength beta [b, S, H_local] and the output norm's gate [b, S, H_local V]."""

    conv_in: Tensor
    g: Tensor
    beta: Tensor
    out_gate: Tensor


class ShortConvDeltaRule(nn.Module):
    """forward(x [b, s, h], docs) -> [b, s, h] (s this rank's tokens under SP); `prefill` and `step` carry a
    `RecurrentCache` for generation. A subclass builds its projections and implements `_project`; this holds
    conv_weight [C, W], norm_weight [V] and out_proj, and `out_activation`, the output gate's activation."""

    out_activation: Callable[[Tensor], Tensor] = staticmethod(F.silu)  # the output gate's (a subclass sets its own)

    def __init__(self, cfg: DeltaLayerConfig, state: ParallelState, *, name: str, seed: int) -> None:
        super().__init__()
        cfg.check(state.tp)
        tp, rank = state.tp, state.tp_rank
        self.cfg, self.state = cfg, state
        self.local_k_heads, self.local_v_heads = cfg.num_key_heads // tp, cfg.num_value_heads // tp
        self.conv_parts = [cfg.key_dim, cfg.key_dim, cfg.value_dim]
        # nn.Conv1d's default bound for a depthwise kernel (layer_init.py)
        conv = conv_init((sum(self.conv_parts), cfg.conv_kernel), cfg.conv_kernel, seed, f"{name}.conv_weight")
        self.conv_weight = nn.Parameter(shard_parts(conv, self.conv_parts, tp, rank))
        self.norm_weight = nn.Parameter(torch.ones(cfg.value_head_dim))
        self.out_proj = RowParallelLinear(cfg.value_dim, cfg.hidden_size, state, name=f"{name}.out_proj", seed=seed,
                                          std=cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def _project(self, x: Tensor) -> Projected:
        raise NotImplementedError

    def param_specs(self) -> dict[str, ParamSpec]:
        return children_specs(self) | {
            "conv_weight": ParamSpec(column(self.conv_parts), matrix=False),
            "norm_weight": ParamSpec(REPLICATED, sp_partial=self.state.tp > 1)}

    def forward(self, x: Tensor, docs: Optional[DocumentIds] = None) -> Tensor:
        doc_ids = None if docs is None else docs.full
        if self.state.cp > 1:
            return self._mix_cp(x, doc_ids)
        return self._mix(x, doc_ids, None, self.cfg.backend)[0]

    def prefill(self, x: Tensor) -> tuple[Tensor, RecurrentCache]:
        """The forward of a prompt (one document per row) and the cache the next token starts from."""
        return self._mix(x, None, None, self.cfg.backend)

    def step(self, x: Tensor, cache: RecurrentCache) -> tuple[Tensor, RecurrentCache]:
        """The next token(s) x [b, t, h] from `cache`: constant work and memory per token."""
        return self._mix(x, None, cache, "recurrent")

    def _rule_inputs(self, mixed: Tensor, p: Projected) -> RuleInputs:
        """The recurrence's inputs from the conv's output [b, S, C_local] and the gates."""
        cfg, (bsz, seq) = self.cfg, mixed.shape[:2]
        q, k, v = F.silu(mixed).split([n // self.state.tp for n in self.conv_parts], dim=-1)
        q = l2_normalize(q.reshape(bsz, seq, self.local_k_heads, cfg.key_head_dim))
        k = l2_normalize(k.reshape(bsz, seq, self.local_k_heads, cfg.key_head_dim))
        v = v.reshape(bsz, seq, self.local_v_heads, cfg.value_head_dim)
        return RuleInputs(q, k, v, p.g, p.beta)

    def _output(self, o: Tensor, gate: Tensor) -> Tensor:
        bsz, seq = o.shape[:2]
        o = gated_rms_norm(o, gate.reshape(bsz, seq, self.local_v_heads, self.cfg.value_head_dim), self.norm_weight,
                           self.cfg.norm_eps, self.out_activation)
        return self.out_proj(o.reshape(bsz, seq, -1))

    def _mix(self, x: Tensor, doc_ids: Optional[Tensor], cache: Optional[RecurrentCache], backend: Backend
             ) -> tuple[Tensor, RecurrentCache]:
        p = self._project(x)
        mixed, conv_state = causal_conv(p.conv_in, self.conv_weight, doc_ids, None if cache is None else cache.conv)
        o, state = gated_delta(self._rule_inputs(mixed, p), doc_ids=doc_ids, scale=self.cfg.key_head_dim ** -0.5,
                               initial_state=None if cache is None else cache.state, backend=backend,
                               chunk_size=self.cfg.chunk_size)
        return self._output(o, p.out_gate), RecurrentCache(conv_state, state)

    def _mix_cp(self, x: Tensor, doc_ids: Optional[Tensor]) -> Tensor:
        """Under context parallelism: x holds this rank's two zigzag slices (megalite/context/zigzag.py). The conv
        takes each slice's last W-1 inputs from the slice before it (an all-gather of every slice's tail) and the
        recurrence its state by state passing (state_passing.py); `doc_ids` are the whole sequences'."""
        st, width = self.state, self.cfg.conv_kernel
        p = self._project(x)
        raw = p.conv_in
        slices = owned_slices(st.cp, st.cp_rank, zigzag=True)
        length = raw.shape[1] // len(slices)
        if length < width - 1:
            raise ValueError(f"cp slices of {length} tokens are shorter than the conv's window of {width - 1}")
        tails = torch.stack([raw[:, (i + 1) * length - (width - 1):(i + 1) * length] for i in range(len(slices))])
        halos = gather_slices(tails, st, zigzag=True)               # [2 cp, b, W-1, C_local], global slice order
        pieces = []
        for i, j in enumerate(slices):
            ids = None if doc_ids is None else doc_ids[:, j * length:(j + 1) * length]
            past_ids = None if doc_ids is None or j == 0 else doc_ids[:, j * length - (width - 1):j * length]
            pieces.append(causal_conv(raw[:, i * length:(i + 1) * length], self.conv_weight, ids,
                                      None if j == 0 else halos[j - 1], past_ids)[0])
        mixed = joined(torch.cat(pieces, dim=1), halos)
        o = state_passing_gated_delta(self._rule_inputs(mixed, p), doc_ids=doc_ids,
                                      scale=self.cfg.key_head_dim ** -0.5, state=st, zigzag=True,
                                      backend=self.cfg.backend, chunk_size=self.cfg.chunk_size)
        return self._output(o, p.out_gate)
