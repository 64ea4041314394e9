"""Closed forms of what a mixture-of-experts layer costs: parameters, all-to-all bytes, FLOPs.

The one home of these formulas: torch-free (moe/__init__.py imports nothing), so the cost model
(megalite/perfmodel/moe.py, moe_plan.py) imports them rather than restating them.

Parameters of a MoE layer replace the dense MLP's (3 h f SwiGLU, 2 h f + biases GeLU) by
  router      E h
  routed      E x (3 h F) (llama) or E x (2 h F) (gpt2 experts have no biases)
  shared      3 h (n_s F_s) (llama) or 2 h (n_s F_s) + n_s F_s + h (a gpt2 MLP with biases)
and a token uses the router, its k experts and the shared ones: active = total - (E - k) x expert.

Expert parallelism moves, per MoE layer and micro-batch, on each rank (dispatch.py; the `CommCounter`
convention for all_to_all: the bytes sent to the other ep ranks):
  counts     (ep - 1) x E/ep x 8 bytes (how many rows go to each expert; int64)
  dispatch   rows sent off-rank x h x b forward, the same rows' gradients back in the combine's backward
  combine    rows received from other ranks x h x b forward, and again in the dispatch's backward
so with balanced routing (each of the T k assignments equally likely on any ep rank) a rank sends
T k (ep - 1)/ep rows each way: 4 x T k (ep - 1)/ep x h x b per layer per micro-batch, plus the counts.

Compute: balanced, a rank's experts take T k rows per layer and micro-batch (ep ranks' T k each over ep
blocks), 2 W_e FLOPs a row forward and twice that backward (W_e: one expert's weights): 6 T k W_e.
Memory: what a MoE layer saves for its backward (its routed rows, the experts' intermediates, the router's
tensors) is `megalite.perfmodel.saved_bytes.moe_layer_extra_bytes`, held equal to autograd's by
tests/test_memory_terms.py.
"""

from __future__ import annotations

from megalite.errors import ConfigError

COUNT_BYTES = 8  # the rows-per-expert counts travel as int64


def expert_params(arch: str, hidden: int, ffn: int) -> int:
    """One routed expert's weights (no biases): SwiGLU's three matrices (llama) or GeLU's two (gpt2)."""
    return (3 if arch == "llama" else 2) * hidden * ffn


def mlp_params(arch: str, hidden: int, ffn: int) -> int:
    """A dense MLP's (or the fused shared experts'): an expert's weights, plus gpt2's two biases."""
    return expert_params(arch, hidden, ffn) + (ffn + hidden if arch == "gpt2" else 0)


def moe_layer_params(arch: str, hidden: int, experts: int, ffn: int, shared_ffn: int) -> int:
    """A MoE layer's MLP: the router, E routed experts of width `ffn`, the shared experts fused into one MLP
    of width `shared_ffn` (n_s x F_s; 0 without)."""
    shared = mlp_params(arch, hidden, shared_ffn) if shared_ffn else 0
    return hidden * experts + experts * expert_params(arch, hidden, ffn) + shared


def count_bytes(experts: int, ep: int) -> int:
    """The counts all-to-all of one forward exchange (module doc)."""
    return (ep - 1) * (experts // ep) * COUNT_BYTES


def rows_sent(tokens: int, top_k: int, ep: int) -> float:
    """Rows a rank sends to the other ep ranks in one direction under balanced routing: T k (ep - 1)/ep."""
    return tokens * top_k * (ep - 1) / ep


def a2a_bytes_balanced(tokens: int, top_k: int, experts: int, hidden: int, ep: int, bytes_per: int) -> float:
    """One rank's all-to-all bytes for one MoE layer and micro-batch of `tokens` local tokens, forward and
    backward, under balanced routing (module doc)."""
    if ep == 1:
        return 0.0
    return 4 * rows_sent(tokens, top_k, ep) * hidden * bytes_per + count_bytes(experts, ep)


def a2a_bytes_measured(off_rank_rows: int, calls: int, ep: int, experts: int, hidden: int, bytes_per: int,
                       forward_passes: int = 1) -> int:
    """The same from a run's measured routing: `off_rank_rows` = rows this rank sent to plus received from
    the other ep ranks over `calls` layer-micro-batches (metrics.jsonl moe.a2a_rows / a2a_calls). Dispatch
    and combine each move those rows forward (forward_passes times: 2 with full recompute, where the
    forward's exchange runs again in the backward) and once backward, plus the counts per forward."""
    if ep == 1:
        return 0
    return (forward_passes + 1) * off_rank_rows * hidden * bytes_per + forward_passes * calls * count_bytes(experts, ep)


def busiest(load_max_over_mean: float | None, ep: int) -> float:
    """The busiest ep rank's expert rows over the balanced T k, at most, given a measured max/mean load per
    expert X: a rank's E/ep experts each hold at most X x mean, and no rank holds more than every row, so
    min(X, ep) (exact when each rank holds one expert). At ep 1 every rank computes every expert: 1."""
    if load_max_over_mean is None or ep == 1:
        return 1.0
    if not load_max_over_mean >= 1:
        raise ConfigError(f"a load max/mean of {load_max_over_mean} is impossible: the busiest expert holds at least "
                          "the mean (metrics.jsonl moe.load_max / moe.load_mean, >= 1)")
    return min(load_max_over_mean, float(ep))


def busiest_a2a_bytes(tokens: int, top_k: int, experts: int, hidden: int, ep: int, bytes_per: int,
                      factor: float) -> float:
    """The busiest ep rank's all-to-all bytes per layer and micro-batch, taking `factor` (`busiest`) times the
    balanced rows: it sends them all back in the combine (its dispatch sends its own T k (ep-1)/ep, as
    balanced), so 2 (1 + factor) of the balanced 4 x rows x h x b."""
    balanced = a2a_bytes_balanced(tokens, top_k, experts, hidden, ep, bytes_per)
    return balanced + 2 * (factor - 1) * rows_sent(tokens, top_k, ep) * hidden * bytes_per


def expert_flops(tokens: int, top_k: int, expert_weights: int) -> float:
    """A rank's expert GEMM FLOPs per layer and micro-batch, forward and backward, balanced (module doc)."""
    return 6.0 * tokens * top_k * expert_weights
