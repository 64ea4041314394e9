"""Context parallelism in the cost model: each cp mode's bytes per step and the part of its transfers that
attention compute does not hide (`Layout.cp_mode`: ring | allgather | a2a | hybrid, megalite/context/options.py).

Ring attention (Liu et al. 2023; megalite/context/ring.py) over cp ranks, per attention layer call, per
micro-batch, in the counter's wire bytes (what one rank sends): with kv = 2·b·(S/cp)·hk·d elements of this
rank's K and V (hk = num_kv_heads/tp: each tp rank runs its own ring on its own heads) and e their element
size (the compute dtype),

    forward   (cp-1)·kv·e          the K/V go once around the ring
    backward  (cp-1)·kv·(e + 4)    the K/V again, plus the fp32 dK/dV accumulator travelling back

and full recompute re-runs the block's forward, ring included, so it sends the forward again. Selective recompute
does not: the ring's backward already keeps only q, k, v, the output and the log-sum-exp (megalite/model/block.py),
so the model does not checkpoint it a second time.
The other modes (megalite/context/allgather.py, a2a.py), per call, hq = num_heads/tp, t = b·(S/cp)·d:

    allgather forward (cp-1)·kv·e, backward (cp-1)·kv·4   (the K/V once, the fp32 dK/dV reduce-scattered)
    a2a       forward = backward = (cp-1)/cp·t·(2·hq + 2·hk)·e   (q, k, v all-to-all'd, the output back)

    hybrid    the a2a's over a = cp_a2a ranks, then the ring's over R = cp/a ranks of the group's S/R tokens
              with hk/a kv heads (megalite/context/hybrid.py)

Neither allgather nor a2a overlaps its transfers with compute in megalite: all of their time is exposed; hybrid's
all-to-all is exposed and its ring overlaps as the ring does (blocks of the S/R tokens and hq/a heads).
These are `megalite/context/costs.py`'s closed forms (restated here so the estimator stays torch-free;
tests/test_estimate_cp.py holds the two equal).

Overlap: at each of the cp-1 ring steps that transfer, a rank posts the next block's send/receive and then
computes its queries against the block it holds, so a step lasts max(transfer, compute); only the excess
of the transfer is exposed. With the zigzag split every step after the first computes a c x 2c block of
scores (c = S/(2cp)), half of a full (S/cp)² block: 2·b·(S/cp)²·hq·d/tp FLOPs forward (two matmuls,
QKᵀ and PV, 2 FLOPs per multiply-add), twice that in backward.
"""

from __future__ import annotations

from megalite.errors import ConfigError
from megalite.perfmodel.inputs import Layout, ModelDims, Precision

GRAD_BYTES = 4  # dK/dV partial sums travel in fp32 (megalite/context/costs.py)


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


def _a2a_bytes(dims: ModelDims, layout: Layout, degree: int, elem_bytes: int) -> float:
    """One direction of the all-to-all over `degree` ranks of this rank's S/cp tokens (q, k, v out, the output
    back): (degree-1)/degree of them leave the rank."""
    tokens = layout.micro_batch_size * layout.local_seq_len(dims.seq_len)
    heads = dims.num_heads // layout.tp + dims.kv_heads // layout.tp
    return float((degree - 1) * tokens * dims.hd * elem_bytes * 2 * heads // degree)


def ring_bytes_per_call(dims: ModelDims, layout: Layout, elem_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends in one cp attention call of one micro-batch, by `layout.cp_mode`
    (the name is the ring's, the default)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    tokens = layout.micro_batch_size * layout.local_seq_len(dims.seq_len)
    if layout.cp_mode == "a2a":
        moved = _a2a_bytes(dims, layout, cp, elem_bytes)
        return moved, moved
    if layout.cp_mode == "hybrid":  # the all-to-all both ways, and the ring of R = cp/a ranks (its K/V: hk/a heads
        a = layout.cp_a2a           # of S/R tokens, as many elements as the whole ring's kv below)
        inner, ring_steps = _a2a_bytes(dims, layout, a, elem_bytes), cp // a - 1
        kv = 2.0 * tokens * (dims.kv_heads // layout.tp // a) * a * dims.hd
        return inner + ring_steps * kv * elem_bytes, inner + ring_steps * kv * (elem_bytes + GRAD_BYTES)
    kv = 2.0 * tokens * (dims.kv_heads // layout.tp) * dims.hd
    if layout.cp_mode == "allgather":
        return (cp - 1) * kv * elem_bytes, (cp - 1) * kv * GRAD_BYTES
    return (cp - 1) * kv * elem_bytes, (cp - 1) * kv * (elem_bytes + GRAD_BYTES)


def cp_held_kv_bytes(dims: ModelDims, layout: Layout, elem_bytes: int) -> float:
    """Activation bytes per layer and micro-batch a mode keeps beyond the ring's: the all-gather form keeps
    every rank's K/V (cp-1 more than its own) from forward to backward; ring and a2a keep S/cp tokens' worth."""
    if layout.cp == 1 or layout.cp_mode != "allgather":
        return 0.0
    kv = 2.0 * layout.micro_batch_size * layout.local_seq_len(dims.seq_len) * (dims.kv_heads // layout.tp) * dims.hd
    return (layout.cp - 1) * kv * elem_bytes


def ring_passes(layout: Layout) -> tuple[int, int]:
    """(forward passes, backward passes) of the ring per layer and micro-batch: full recompute re-runs the forward."""
    return (2 if layout.recompute == "full" else 1), 1


def cp_comm_bytes(dims: ModelDims, layout: Layout, prec: Precision, m: int) -> float:
    """Bytes one rank sends over its cp ring in one optimizer step: per layer of its stage and micro-batch,
    the forward (twice under full recompute) and the backward ring."""
    fwd, bwd = ring_bytes_per_call(dims, layout, prec.activation)
    n_fwd, n_bwd = ring_passes(layout)
    # Document masking: each model chunk's forward all-gathers the int64 token ids over cp (megalite/model/gpt.py)
    ids = (layout.cp - 1) * layout.micro_batch_size * layout.local_seq_len(dims.seq_len) * 8 * layout.vpp \
        if layout.document_mask else 0
    return float(m) * (dims.num_layers / layout.pp * (n_fwd * fwd + n_bwd * bwd) + ids)


def ring_exposed_seconds(dims: ModelDims, layout: Layout, prec: Precision, m: int, flops_per_s: float,
                         bytes_per_s: float, inner_bytes_per_s: float | None = None) -> float:
    """Seconds per step the ring's transfers add to the critical path: per ring step, max(0, transfer -
    compute of the block), summed over the cp-1 transferring steps, the passes, the layers of the stage
    and the micro-batches. `flops_per_s` is the achieved rate (efficiency x peak). `inner_bytes_per_s`: the
    speed of hybrid's all-to-all (inside a node when tp x cp_a2a ranks fit one; default `bytes_per_s`)."""
    if layout.cp == 1:
        return 0.0
    fwd, bwd = ring_bytes_per_call(dims, layout, prec.activation)
    n_fwd, n_bwd = ring_passes(layout)
    calls = float(m) * dims.num_layers / layout.pp
    if layout.cp_mode in ("allgather", "a2a"):  # collectives on the critical path, nothing hides them
        return calls * (n_fwd * fwd + n_bwd * bwd) / bytes_per_s
    a = layout.cp_a2a if layout.cp_mode == "hybrid" else 1
    inner = _a2a_bytes(dims, layout, a, prec.activation) if a > 1 else 0.0  # hybrid's all-to-all: exposed
    steps = layout.cp // a - 1
    inner_s = inner / (inner_bytes_per_s or bytes_per_s)
    if steps == 0:
        return calls * (n_fwd + n_bwd) * inner_s
    s_ring = dims.seq_len // (layout.cp // a)  # the ring's local tokens, for 1/a of the heads
    block_flops = 2.0 * layout.micro_batch_size * s_ring * s_ring * dims.num_heads * dims.hd / layout.tp / a
    exposed_fwd = max(0.0, (fwd - inner) / steps / bytes_per_s - block_flops / flops_per_s)
    exposed_bwd = max(0.0, (bwd - inner) / steps / bytes_per_s - 2.0 * block_flops / flops_per_s)
    return calls * ((n_fwd + n_bwd) * inner_s + steps * (n_fwd * exposed_fwd + n_bwd * exposed_bwd))
