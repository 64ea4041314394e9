"""Each layer's mixer in the cost model: full or sliding-window attention, or a linear_attention (Gated DeltaNet)
layer (`ModelDims.linear_layers`, megalite/model/pattern.py). A linear layer is priced as what it computes, by the
closed forms of megalite/recurrent/costs.py (their one home): its projections and conv as weights, the chunked
recurrence's FLOPs (linear in the sequence, no s^2 term), its saved tensors, its state (the generation cache,
constant in the tokens) and, under context parallelism, the state-passing exchange (independent of the sequence).

Layers of unequal cost are split over pipeline stages by cost, as a run splits them (`stage_layers`: the same
`pipeline.partition.balanced_counts` that config.layers.balanced_pp_layers calls); the slowest stage sets the pace.
Plain Python (no torch).
"""

from __future__ import annotations

from megalite.attention.costs import visible_pairs
from megalite.model.pattern import LINEAR_CHUNK
from megalite.perfmodel.inputs import ModelDims
from megalite.recurrent.costs import (RecurrentDims, chunked_flops, cp_conv_halo_bytes, cp_exchange_bytes,
                                      matmul_weights, state_bytes)


def recurrent_dims(dims: ModelDims) -> RecurrentDims | None:
    """The linear layers' shape in the recurrence's cost formulas (None: the model has none)."""
    return None if dims.linear is None or not dims.linear_layers else dims.linear.recurrent()


def is_linear(dims: ModelDims, index: int) -> bool:
    return index in dims.linear_layers


def attention_windows(dims: ModelDims) -> tuple[int | None, ...]:
    """The attention layers' windows (None: full), linear layers left out; () when every layer is full attention
    (`flops.attention_keys`' "all full")."""
    if not dims.linear_layers and not dims.windows:
        return ()
    windows = dims.windows or (None,) * dims.num_layers
    return tuple(w for i, w in enumerate(windows) if not is_linear(dims, i))


def linear_core_flops(dims: ModelDims, seq_len: int | None = None) -> float:
    """Forward FLOPs per token of every linear layer's recurrence (the chunked form, chunk 64:
    `recurrent.costs.chunked_flops`, its triangular solves included), summed over the linear layers."""
    d = recurrent_dims(dims)
    if d is None:
        return 0.0
    s = dims.seq_len if seq_len is None else seq_len
    return len(dims.linear_layers) * chunked_flops(d, 1, s, LINEAR_CHUNK) / s


def mixer_weights(dims: ModelDims, index: int) -> int:
    """Layer `index`'s mixer weights used once per token in a multiply-add (2 FLOPs forward each)."""
    d = recurrent_dims(dims)
    if d is not None and is_linear(dims, index):
        return matmul_weights(d, dims.hidden_size)
    h, q, kv = dims.hidden_size, dims.num_heads * dims.hd, dims.kv_heads * dims.hd
    return h * (q + 2 * kv) + q * h


def layer_forward_flops(dims: ModelDims) -> list[float]:
    """Each layer's forward FLOPs per token: 2 x its weights (the MLP of a MoE layer: the k experts a token goes
    through, the shared ones and the router) plus its mixer's core: 4·H·Q x the keys its queries see (causal: the
    pairs computed, `attention.costs.visible_pairs`), or the linear layer's chunked recurrence. What the pipeline
    partition balances and the slowest stage is priced by."""
    h, s, width = dims.hidden_size, dims.seq_len, 3 if dims.arch == "llama" else 2
    windows = dims.windows or (None,) * dims.num_layers
    rule = linear_core_flops(dims) / max(1, len(dims.linear_layers))
    out = []
    for i in range(dims.num_layers):
        moe = dims.moe
        if moe is not None and i in moe.layers:
            mlp = width * h * (moe.top_k * moe.ffn + moe.shared * moe.shared_ffn) + h * moe.experts
        else:
            mlp = width * h * dims.ffn
        core = rule if is_linear(dims, i) else 4.0 * dims.num_heads * dims.hd * visible_pairs(s, windows[i]) / s
        out.append(2.0 * (mixer_weights(dims, i) + mlp) + core)
    return out


def uniform(dims: ModelDims) -> bool:
    """Every layer costs the same (no windows, no linear layers): the even split."""
    return not dims.linear_layers and not dims.windows


def stage_counts(dims: ModelDims, stages: int) -> list[int]:
    """Layers per (virtual) pipeline stage: the even split, or by cost when the layers differ."""
    if uniform(dims) or stages <= 1 or stages > dims.num_layers:
        return [dims.num_layers // stages] * stages
    from megalite.pipeline.partition import balanced_counts  # (megalite.pipeline's package imports torch)

    return balanced_counts(layer_forward_flops(dims), stages)


def stage_layers(dims: ModelDims, pp: int, pp_rank: int, vpp: int = 1, v_shape: bool = False) -> list[int]:
    """The global layers pipeline rank `pp_rank` holds (its vpp chunks), as the run partitions them."""
    starts = [0]
    for c in stage_counts(dims, pp * vpp):
        starts.append(starts[-1] + c)
    if vpp == 1 and not v_shape:
        return list(range(starts[pp_rank], starts[pp_rank + 1]))
    from megalite.pipeline.partition import chunk_virtual_stages

    return [i for v in chunk_virtual_stages(pp_rank, pp, vpp, v_shape) for i in range(starts[v], starts[v + 1])]


def pipeline_imbalance(dims: ModelDims, stages: int) -> float:
    """The costliest (virtual) stage over the mean one (1.0: balanced), the layers split as `stage_layers` splits
    them: the step waits for the slowest stage."""
    if uniform(dims) or stages <= 1 or stages > dims.num_layers:
        return 1.0
    costs = layer_forward_flops(dims)
    start, worst = 0, 0.0
    for c in stage_counts(dims, stages):
        worst, start = max(worst, sum(costs[start:start + c])), start + c
    return worst * stages / sum(costs)


def linear_cache_bytes(dims: ModelDims, batch: int, act_bytes: int) -> int:
    """The linear layers' generation cache: each one's state [H, K, V] fp32 and conv window, per `batch` sequences,
    whatever the number of tokens (`recurrent.costs.state_bytes`)."""
    d = recurrent_dims(dims)
    return 0 if d is None else len(dims.linear_layers) * state_bytes(d, batch, act_bytes)


def linear_cp_bytes(dims: ModelDims, layers: int, batch: int, tp: int, cp: int, act_bytes: int) -> float:
    """Bytes one rank sends for `layers` linear layers' context parallelism by state passing, forward (the
    backward's reduce-scatters as much again): each slice's affine map of the state and the conv's halo, two zigzag
    slices per rank, this tp rank's heads (`recurrent.costs.cp_exchange_bytes`, `cp_conv_halo_bytes`)."""
    d = recurrent_dims(dims)
    if d is None or cp == 1 or not layers:
        return 0.0
    mine = d.split(tp)
    return float(layers * (cp_exchange_bytes(mine, batch, cp, slices_per_rank=2)
                           + cp_conv_halo_bytes(mine, batch, cp, act_bytes, slices_per_rank=2)))
