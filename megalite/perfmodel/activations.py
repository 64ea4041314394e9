"""Activation memory per rank: Korthikanti et al. 2022's per-layer bytes, the micro-batches a pipeline
stage holds, the last stage's logits; every term for the S/cp tokens a rank holds under context parallelism.
"""

from __future__ import annotations

from megalite.mla import costs as mla_costs
from megalite.mtp.costs import mtp_activation_bytes
from megalite.perfmodel.context import cp_held_kv_bytes
from megalite.model.pattern import LINEAR_CHUNK
from megalite.perfmodel.inputs import Layout, ModelDims, Precision
from megalite.perfmodel.mixers import recurrent_dims, stage_layers
from megalite.recurrent.costs import chunks
from megalite.perfmodel.schedules import microbatches_in_flight


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", kv_len: int | None = None) -> float:
    """Activation memory of one transformer layer, Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models"), table 2, for 16-bit activations:
        no parallelism             sbh(34 + 5as/h)
        TP t                       sbh(10 + 24/t + 5as/(ht))
        TP t + SP                  sbh(34/t + 5as/(ht))
        TP t + SP + selective      34·sbh/t          (the 5as²b attention terms are recomputed)
        full recompute             2·sbh (only the layer input; /t with SP)
    The paper's layer is GPT-3's (LayerNorm, GeLU 4h MLP, dropout masks): for SwiGLU models it is an
    estimate. Other activation widths scale it linearly (x act_bytes / 2), which for fp32 over-counts the
    1-byte dropout masks slightly.

    `s` is the tokens this rank holds, `kv_len` the keys each of its queries attends over (default `s`).
    Under context parallelism s = S/cp and kv_len = S: the 5as²b score terms become 5·a·(S/cp)·S·b, the
    local queries against the whole sequence, i.e. 1/cp of the unsplit layer's, like every sbh term.
    """
    sbh = float(s) * b * h
    if recompute == "full":
        return 2.0 * sbh / (tp if sp else 1)
    attn_core = 5.0 * a * (s if kv_len is None else kv_len) / (h * tp)
    if recompute == "selective":
        attn_core = 0.0
    if tp == 1:
        return sbh * (34.0 + attn_core)
    if sp:
        return sbh * (34.0 / tp + attn_core)
    return sbh * (10.0 + 24.0 / tp + attn_core)


def stage_activation_bytes(dims: ModelDims, layout: Layout, prec: Precision, pp_rank: int,
                           m: int) -> float:
    """Peak activation bytes on one stage: per-layer bytes x its layers x micro-batches in flight,
    plus (full recompute) one layer's full activations while it is recomputed, plus (last stage)
    one micro-batch's fp32 logits [b, s, V/t] held for the loss. Under context parallelism every term
    is for this rank's S/cp tokens, attending over all S keys: exactly 1/cp of the cp = 1 bytes.
    The ring keeps only this rank's own K/V (S/cp tokens, already in the sbh terms) for the backward,
    never the other ranks' blocks (one is in flight at a time: transient, like other temporaries)."""
    b, h, a = layout.micro_batch_size, dims.hidden_size, dims.num_heads
    s = layout.local_seq_len(dims.seq_len)

    d = recurrent_dims(dims)

    def per_linear_layer(recompute: str) -> float:
        """A linear layer: the paper's sbh terms without the s^2 scores (its projections' inputs and outputs are of
        the same order), plus the fp32 state entering each chunk, N·H·K·V·4 per sequence (/t: heads split)."""
        assert d is not None
        mine = d.split(layout.tp)
        states = 0.0 if recompute == "full" else float(b * chunks(s, LINEAR_CHUNK) * mine.heads * d.key_dim
                                                       * d.value_dim * 4)
        return prec.activation / 2.0 * activation_bytes_per_layer(s, b, h, 0, layout.tp, layout.sp, recompute) + states

    def per_layer(recompute: str) -> float:
        held = 0.0 if recompute == "full" else cp_held_kv_bytes(dims, layout, prec.activation)  # allgather's K/V
        if dims.mla is not None:  # multi-head latent attention's own count (megalite/mla/costs.py)
            return held + prec.activation / 2.0 * mla_costs.activation_bytes_per_layer(
                s * b, h, a, dims.mla, dims.seq_len, layout.tp, layout.sp, recompute)
        scale = prec.activation / 2.0  # the formula is for 16-bit activations
        return held + scale * activation_bytes_per_layer(s, b, h, a, layout.tp, layout.sp, recompute,
                                                         kv_len=dims.seq_len)

    layers = stage_layers(dims, layout.pp, pp_rank, layout.vpp, layout.schedule == "zbv")
    linear = sum(i in dims.linear_layers for i in layers)
    kinds = [(len(layers) - linear, per_layer)] + ([(linear, per_linear_layer)] if linear else [])
    acts = sum(n * f(layout.recompute) for n, f in kinds) * microbatches_in_flight(layout, pp_rank, m)
    if layout.recompute == "full":  # the block being recomputed: the largest kind the stage holds
        acts += max(f("none") for n, f in kinds if n)
    if pp_rank == layout.pp - 1:
        acts += float(b) * s * dims.padded_vocab(layout.tp) / layout.tp * 4
        if dims.mtp_layers:  # the multi-token prediction modules (megalite/mtp/costs.py), never recomputed
            block = per_layer("none" if layout.recompute == "full" else layout.recompute)
            tokens = b * s // (layout.tp if layout.sp else 1)
            acts += microbatches_in_flight(layout, pp_rank, m) * mtp_activation_bytes(
                dims.mtp_layers, tokens, h, dims.padded_vocab(layout.tp) // layout.tp, prec.activation, block)
    return acts
