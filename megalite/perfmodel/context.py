"""Context parallelism in the cost model: each cp mode's bytes per step and the part of its transfers that
attention compute does not hide (`Layout.cp_mode`: ring | allgather | a2a | hybrid, megalite/context/options.py).

The bytes per attention call, the document ids' gather and the ring's compute per step are
`megalite/context/costs.py`'s closed forms (their one home, torch-free; its docstring has the table). Here they
are priced per step: per layer of a rank's stage and micro-batch, the forward (twice under full recompute,
which re-runs the block's forward, cp exchange included) and the backward.

Overlap: at each of the cp-1 ring steps that transfer, a rank posts the next block's send/receive and then
computes its queries against the block it holds, so a step lasts max(transfer, compute); only the excess of the
transfer is exposed. Neither allgather nor a2a overlaps its transfers with compute in megalite: all of their
time is exposed; hybrid's all-to-all is exposed and its ring overlaps as the ring does (blocks of the S/R
tokens and hq/a heads).
"""

from __future__ import annotations

from megalite.context.costs import (a2a_attention_bytes, cp_attention_bytes, document_ids_bytes, local_kv_elements,
                                    ring_step_flops)
from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.perfmodel.inputs import Layout, ModelDims, Precision
from megalite.perfmodel.mixers import linear_cp_bytes, stage_layers


def a2a_degree(layout: Layout) -> int:
    """Ranks of one all-to-all: cp under a2a, cp_a2a under hybrid, 1 (none) under ring and allgather."""
    return {"a2a": layout.cp, "hybrid": layout.cp_a2a}.get(layout.cp_mode, 1)


def check_cp_mode(dims: ModelDims, layout: Layout) -> None:
    """a2a gives each cp rank 1/cp of a tp rank's query and kv heads (hybrid: 1/cp_a2a): a ConfigError unless
    both split."""
    heads, kv = dims.num_heads // layout.tp, dims.kv_heads // layout.tp
    degree = a2a_degree(layout)
    if layout.cp > 1 and (heads % degree or kv % degree):
        name = "cp" if layout.cp_mode == "a2a" else f"cp_a2a={degree}"
        raise ConfigError(f"cp_mode={layout.cp_mode} at cp={layout.cp}: {heads} query and {kv} kv heads per tp rank "
                          f"are not both divisible by {name}; use cp_mode=ring or allgather, or a smaller "
                          f"{'cp' if layout.cp_mode == 'a2a' else 'cp_a2a'} (or tp)")


def _hybrid_a2a_bytes(dims: ModelDims, layout: Layout, elem_bytes: int) -> float:
    """One direction of hybrid's all-to-all (over cp_a2a ranks, this rank's S/cp tokens): its exposed part."""
    a, ring = layout.cp_a2a, layout.cp // layout.cp_a2a
    return float(a2a_attention_bytes(layout.micro_batch_size, dims.seq_len // ring, dims.num_heads // layout.tp,
                                     dims.kv_heads // layout.tp, dims.hd, a, elem_bytes).forward)


def ring_bytes_per_call(dims: ModelDims, layout: Layout, elem_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends in one cp attention call of one micro-batch, by `layout.cp_mode`
    (the name is the ring's, the default): `context.costs.cp_attention_bytes`."""
    if layout.cp == 1:
        return 0.0, 0.0
    layout.local_seq_len(dims.seq_len)  # the zigzag split's rule: a ConfigError unless 2 cp divides S
    moved = cp_attention_bytes(ContextOptions.of(layout.cp_mode, a2a_degree=layout.cp_a2a), layout.micro_batch_size,
                               dims.seq_len, dims.num_heads // layout.tp, dims.kv_heads // layout.tp, dims.hd,
                               layout.cp, elem_bytes)
    return float(moved.forward), float(moved.backward)


def cp_held_kv_bytes(dims: ModelDims, layout: Layout, elem_bytes: int) -> float:
    """Activation bytes per layer and micro-batch a mode keeps beyond the ring's: the all-gather form keeps
    every rank's K/V (cp-1 more than its own) from forward to backward; ring and a2a keep S/cp tokens' worth."""
    if layout.cp == 1 or layout.cp_mode != "allgather":
        return 0.0
    kv = local_kv_elements(layout.micro_batch_size, dims.seq_len, dims.kv_heads // layout.tp, dims.hd, layout.cp)
    return float((layout.cp - 1) * kv * elem_bytes)


def ring_passes(layout: Layout) -> tuple[int, int]:
    """(forward passes, backward passes) of the ring per layer and micro-batch: full recompute re-runs the forward."""
    return (2 if layout.recompute == "full" else 1), 1


def stage_mixers(dims: ModelDims, layout: Layout, pp_rank: int | None) -> tuple[float, float]:
    """(attention layers, linear layers) of pipeline rank `pp_rank`'s stage (None: the mean stage's)."""
    if pp_rank is None:
        linear = len(dims.linear_layers) / layout.pp
        return dims.num_layers / layout.pp - linear, linear
    layers = stage_layers(dims, layout.pp, pp_rank, layout.vpp, layout.schedule == "zbv")
    linear = sum(i in dims.linear_layers for i in layers)
    return float(len(layers) - linear), float(linear)


def cp_comm_bytes(dims: ModelDims, layout: Layout, prec: Precision, m: int, pp_rank: int | None = None) -> float:
    """Bytes one rank sends over cp in one optimizer step: per attention layer of its stage and micro-batch, the
    forward (twice under full recompute) and the backward ring; per linear layer the state-passing exchange
    (`mixers.linear_cp_bytes`: forward and the backward's as much, whatever the sequence length)."""
    fwd, bwd = ring_bytes_per_call(dims, layout, prec.activation)
    n_fwd, n_bwd = ring_passes(layout)
    ids = document_ids_bytes(layout.micro_batch_size, dims.seq_len, layout.cp) * layout.vpp if layout.document_mask else 0
    attention, linear = stage_mixers(dims, layout, pp_rank)
    passing = (n_fwd + n_bwd) * linear_cp_bytes(dims, 1, layout.micro_batch_size, layout.tp, layout.cp,
                                                prec.activation)
    return float(m) * (attention * (n_fwd * fwd + n_bwd * bwd) + linear * passing + ids)


def ring_exposed_seconds(dims: ModelDims, layout: Layout, prec: Precision, m: int, flops_per_s: float,
                         bytes_per_s: float, inner_bytes_per_s: float | None = None) -> float:
    """Seconds per step the ring's transfers add to the critical path: per ring step, max(0, transfer -
    compute of the block), summed over the cp-1 transferring steps, the passes, the layers of the stage
    and the micro-batches. `flops_per_s` is the achieved rate (efficiency x peak). `inner_bytes_per_s`: the
    speed of hybrid's all-to-all (inside a node when tp x cp_a2a ranks fit one; default `bytes_per_s`).
    The linear layers' state passing is a collective on the critical path: all of it is exposed."""
    if layout.cp == 1:
        return 0.0
    n_fwd, n_bwd = ring_passes(layout)
    attention, linear = stage_mixers(dims, layout, None)
    passing = float(m) * linear * (n_fwd + n_bwd) * linear_cp_bytes(dims, 1, layout.micro_batch_size, layout.tp,
                                                                     layout.cp, prec.activation) / bytes_per_s
    return passing + _attention_exposed(dims, layout, prec, float(m) * attention, flops_per_s, bytes_per_s,
                                        inner_bytes_per_s)


def _attention_exposed(dims: ModelDims, layout: Layout, prec: Precision, calls: float, flops_per_s: float,
                       bytes_per_s: float, inner_bytes_per_s: float | None) -> float:
    """`ring_exposed_seconds`' attention part over `calls` attention calls (layers x micro-batches)."""
    fwd, bwd = ring_bytes_per_call(dims, layout, prec.activation)
    n_fwd, n_bwd = ring_passes(layout)
    if layout.cp_mode in ("allgather", "a2a"):  # collectives on the critical path, nothing hides them
        return calls * (n_fwd * fwd + n_bwd * bwd) / bytes_per_s
    a = layout.cp_a2a if layout.cp_mode == "hybrid" else 1
    inner = _hybrid_a2a_bytes(dims, layout, prec.activation) if a > 1 else 0.0  # hybrid's all-to-all: exposed
    steps = layout.cp // a - 1
    inner_s = inner / (inner_bytes_per_s or bytes_per_s)
    if steps == 0:
        return calls * (n_fwd + n_bwd) * inner_s
    # the ring over R = cp/a ranks: the group's S/R tokens, 1/a of the heads
    block_flops = ring_step_flops(layout.micro_batch_size, dims.seq_len, dims.num_heads // layout.tp // a, dims.hd,
                                  layout.cp // a)
    exposed_fwd = max(0.0, (fwd - inner) / steps / bytes_per_s - block_flops / flops_per_s)
    exposed_bwd = max(0.0, (bwd - inner) / steps / bytes_per_s - 2.0 * block_flops / flops_per_s)
    return calls * ((n_fwd + n_bwd) * inner_s + steps * (n_fwd * exposed_fwd + n_bwd * exposed_bwd))
