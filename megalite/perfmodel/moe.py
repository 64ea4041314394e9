"""Mixture of experts in the estimator: total vs active parameters, per-rank expert memory, all-to-all bytes.

Parameters of a MoE layer replace the dense MLP's (3 h f SwiGLU, 2 h f + biases-free GeLU experts) by
  router      E h
  routed      E x (3 h F) (llama) or E x (2 h F) (gpt2 experts have no biases)
  shared      3 h (n_s F_s) (llama) or 2 h (n_s F_s) + n_s F_s + h (a gpt2 MLP with biases)
and a token uses the router, its k experts and the shared ones: active = total - (E - k) x expert.

Expert parallelism moves, per MoE layer and micro-batch, on each rank (the `CommCounter` convention for
all_to_all: the bytes sent to the other ep ranks):
  counts     (ep - 1) x E/ep x 8 bytes (how many rows go to each expert; int64)
  dispatch   rows sent off-rank x h x b forward, the same rows' gradients back in the combine's backward
  combine    rows received from other ranks x h x b forward, and again in the dispatch's backward
so with balanced routing (each of the T k assignments equally likely on any ep rank) a rank sends
T k (ep - 1)/ep rows each way: 4 x T k (ep - 1)/ep x h x b per layer per micro-batch, plus the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.moe.settings import MoESettings, moe_layers
from megalite.perfmodel.estimate import count_params


@dataclass(frozen=True)
class MoEParams:
    total: int
    active: int
    experts: int          # routed-expert parameters of the whole model (split over ep)


def expert_params(arch: str, hidden: int, ffn: int) -> int:
    return (3 if arch == "llama" else 2) * hidden * ffn


def moe_param_counts(m: Any) -> MoEParams:
    """Total and active parameters of model config `m` (resolved; the dense count when it has no MoE)."""
    tie = bool(m.tie_embeddings)
    dense = count_params(m.arch, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size,
                         m.vocab_size, m.seq_len, tie)
    s = MoESettings.from_model(m)
    if s is None:
        return MoEParams(dense, dense, 0)
    n = len(moe_layers(m))
    h = m.hidden_size
    dense_mlp = expert_params(m.arch, h, m.ffn_hidden_size) + (m.ffn_hidden_size + h if m.arch == "gpt2" else 0)
    one = expert_params(m.arch, h, s.ffn)
    shared = 0
    if s.shared:
        fs = s.shared * s.shared_ffn
        shared = expert_params(m.arch, h, fs) + (fs + h if m.arch == "gpt2" else 0)
    per_layer = h * s.experts + s.experts * one + shared
    total = dense + n * (per_layer - dense_mlp)
    return MoEParams(total, total - n * (s.experts - s.top_k) * one, n * s.experts * one)


def a2a_bytes_balanced(tokens: int, top_k: int, experts: int, hidden: int, ep: int, bytes_per: int) -> float:
    """One rank's all-to-all bytes for one MoE layer and micro-batch of `tokens` local tokens, forward and
    backward, under balanced routing (module doc)."""
    if ep == 1:
        return 0.0
    rows = tokens * top_k * (ep - 1) / ep
    return 4 * rows * hidden * bytes_per + (ep - 1) * (experts // ep) * 8


def a2a_bytes_measured(off_rank_rows: int, calls: int, ep: int, experts: int, hidden: int, bytes_per: int,
                       forward_passes: int = 1) -> int:
    """The same from a run's measured routing: `off_rank_rows` = rows this rank sent to plus received from
    the other ep ranks over `calls` layer-micro-batches (metrics.jsonl moe.a2a_rows / a2a_calls). Dispatch
    and combine each move those rows forward (forward_passes times: 2 with full recompute, where the
    forward's exchange runs again in the backward) and once backward, plus the counts per forward."""
    if ep == 1:
        return 0
    counts = (ep - 1) * (experts // ep) * 8
    return (forward_passes + 1) * off_rank_rows * hidden * bytes_per + forward_passes * calls * counts
