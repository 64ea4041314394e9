"""Parameters per rank, exactly: each layer's tp-split, tp-replicated and routed-expert elements, and a pipeline
stage's sum with its embedding rows and the multi-token prediction modules on the last stage. Plain Python
(no torch), like the rest of the cost model; `megalite.perfmodel.estimate` prices memory and time from it."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.errors import ConfigError
from megalite.mla import costs as mla_costs
from megalite.model.params import ParamShape, count_params
from megalite.mtp.costs import mtp_params, stage_copy_params
from megalite.perfmodel.inputs import ModelDims
from megalite.perfmodel.mixers import recurrent_dims, stage_layers
from megalite.recurrent.costs import layer_params as linear_layer_params


def dims_params(dims: ModelDims) -> int:
    """Every parameter of the model, its multi-token prediction modules included; a linear_attention layer has the
    Gated DeltaNet's parameters where the others have the attention's."""
    linear = _linear_split(dims, 1)
    delta = len(dims.linear_layers) * (sum(linear) - _attention_params(dims)) if linear else 0
    return _count(dims, dims.num_layers) + delta + mtp_params(dims.mtp_layers, dims.hidden_size, block_params(dims))


def _attention_params(dims: ModelDims) -> int:
    """The q/k/v/o weights `count_params` gives each layer (llama: no biases; linear layers are llama only)."""
    q, kv = dims.num_heads * dims.hd, dims.kv_heads * dims.hd
    return dims.hidden_size * (q + 2 * kv) + q * dims.hidden_size


def _linear_split(dims: ModelDims, tp: int) -> tuple[int, int] | None:
    """(tp-split, replicated) parameters of one linear_attention layer's mixer on one rank: its heads' projections,
    conv channels, A_log and dt_bias split; the gated norm's weight [V] whole on every rank. None: no such layer."""
    d = recurrent_dims(dims)
    if d is None:
        return None
    return linear_layer_params(d.split(tp), dims.hidden_size) - d.value_dim, d.value_dim


def _count(dims: ModelDims, layers: int) -> int:
    return count_params(ParamShape(dims.arch, layers, dims.hidden_size, dims.num_heads, dims.kv_heads, dims.ffn,
                                   dims.vocab_size, dims.seq_len, dims.tied, dims.head_dim, dims.mla))


def block_params(dims: ModelDims) -> int:
    """One transformer block's parameters."""
    return _count(dims, 1) - _count(dims, 0)


@dataclass(frozen=True)
class StageParams:
    """One (pp stage, tp rank)'s parameter elements, split by how they are synchronised."""

    total: int
    tp_replicated_partial: int  # norms, row-parallel biases, positions, routers: grads all-reduced over TP under SP
    embedding_shard: int  # vocab-parallel rows this rank holds (0 off the first/last stage)
    layers: int
    experts: int = 0  # routed-expert parameters this rank holds (in `total` and `layers`; ZeRO shards them over edp)
    largest_layer: int = 0  # the largest block's parameters on this rank (ZeRO-3 gathers one block at a time)


def layer_params(dims: ModelDims, tp: int, index: int, ep: int = 1) -> tuple[int, int, int]:
    """(tp-split, replicated, routed-expert) parameter elements of layer `index` on one rank. A MoE layer
    (`dims.moe`) swaps the dense MLP for a replicated router (E x h), E/ep whole experts (llama 3·h·F, gpt2 2·h·F)
    and the shared experts' MLP, tp-split like the dense one."""
    h, t, hd = dims.hidden_size, tp, dims.hd
    q, kv = dims.num_heads * hd, dims.kv_heads * hd
    gpt2 = dims.arch == "gpt2"
    width = 2 if gpt2 else 3

    def mlp(f: int) -> tuple[int, int]:  # (tp-split, replicated: gpt2's row-parallel bias)
        return (width * h * f + (f if gpt2 else 0)) // t, (h if gpt2 and f else 0)

    split = (h * (q + 2 * kv) + q * h + ((q + 2 * kv) if gpt2 else 0)) // t
    replicated = 5 * h if gpt2 else 2 * h  # two norms (gpt2: weight + bias each, + the attention's out bias)
    if (linear := _linear_split(dims, tp)) is not None and index in dims.linear_layers:
        split, replicated = linear[0], replicated + linear[1]  # Gated DeltaNet in place of the attention
    if dims.mla is not None:  # q_b / q, kv_b, out split by heads; q_a, kv_a and the latents' norms replicated
        attn, whole = mla_costs.attention_weights(h, dims.num_heads, dims.mla)
        split = attn // t
        replicated += whole + dims.mla.q_lora_rank + dims.mla.kv_lora_rank
    moe = dims.moe
    if moe is None or index not in moe.layers:
        m_split, m_rep = mlp(dims.ffn)
        return split + m_split, replicated + m_rep, 0
    if moe.experts % ep:
        raise ConfigError(f"ep={ep} must divide the {moe.experts} experts")
    m_split, m_rep = mlp(moe.shared * moe.shared_ffn)
    experts = moe.experts // ep * width * h * moe.ffn
    return split + m_split, replicated + m_rep + moe.experts * h, experts


def stage_params(dims: ModelDims, tp: int, pp: int, pp_rank: int, ep: int = 1, vpp: int = 1) -> StageParams:
    """Exact parameters on one rank: layers split evenly over pp (by cost when they differ, `mixers.stage_layers`;
    a rank's `vpp` chunks), weights split over tp,
    norms (and gpt2's row-parallel biases and positions) replicated, the vocabulary padded to a
    multiple of tp x make_vocab_divisible_by; a MoE model's routed experts split over ep (`layer_params`).
    With a tied head and pp > 1 the last stage holds its own copy of the embedding shard (synchronised over
    the 'embedding' group, as Megatron)."""
    h, t, f = dims.hidden_size, tp, dims.ffn
    if dims.num_heads % t or dims.kv_heads % t or f % t:
        raise ConfigError(f"tp={t} must divide num_heads ({dims.num_heads}), num_kv_heads "
                          f"({dims.kv_heads}) and ffn_hidden_size ({f}); pick a smaller parallel.tp")
    if dims.linear is not None and dims.linear_layers and (dims.linear.key_heads % t or dims.linear.value_heads % t):
        raise ConfigError(f"tp={t} must divide the linear layers' key heads ({dims.linear.key_heads}) and value heads "
                          f"({dims.linear.value_heads}); pick a smaller parallel.tp")
    gpt2 = dims.arch == "gpt2"
    blocks = [layer_params(dims, t, i, ep) for i in stage_layers(dims, pp, pp_rank, vpp)]
    first, last = pp_rank == 0, pp_rank == pp - 1
    emb = dims.padded_vocab(t) // t * h
    rows = (emb if first else 0) + (emb if last and (not dims.tied or pp > 1) else 0)
    partial = sum(r for _, r, _ in blocks)
    if first and gpt2:
        partial += dims.seq_len * h  # learned positions
    if last:
        partial += 2 * h if gpt2 else h  # final norm
    mtp = dims.mtp_layers if last else 0  # the MTP modules: a block, a replicated 2h x h eh_proj and 3 norms each
    mtp_blocks = [layer_params(dims, t, dims.num_layers + k, ep) for k in range(mtp)]
    partial += sum(r for _, r, _ in mtp_blocks) + mtp * (2 * h * h + 3 * h)
    rows += stage_copy_params(mtp, pp, dims.tied, emb // h, h)  # the embedding's copy they read (pp > 1, untied)
    layers = sum(sum(b) for b in blocks)
    total = layers + sum(sp + e for sp, _, e in mtp_blocks) + partial - sum(r for _, r, _ in blocks) + rows
    return StageParams(total=total, tp_replicated_partial=partial, embedding_shard=rows, layers=layers,
                       experts=sum(e for _, _, e in blocks + mtp_blocks),
                       largest_layer=max((sum(b) for b in blocks), default=0))
