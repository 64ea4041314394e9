"""What one transformer layer saves for its backward, per micro-batch, as megalite's blocks save them: the activation
terms of the peak memory model (`megalite.perfmodel.peak_memory`; docs/estimator.md#peak-memory). Each function is
held equal to the bytes autograd really saves by tests/test_memory_terms.py. Plain Python (no torch)."""

from __future__ import annotations

from megalite.model.pattern import LINEAR_CHUNK
from megalite.perfmodel.inputs import Layout, ModelDims, Precision
from megalite.perfmodel.mixers import recurrent_dims
from megalite.recurrent.costs import saved_bytes as gdn_saved_bytes


def fp8_saved_delta(dims: ModelDims, layout: Layout, prec: Precision, fp8: tuple[str, int] | None,
                    attention: bool = True) -> float:
    """Bytes per token an FP8 layer saves beyond (negative: below) the run dtype's (`megalite.fp8.linear`): under
    `tensorwise` each FP8 linear (min(in, every logical output part) >= min_dim) keeps its 1-byte quantised input
    instead of the input itself. The qkv, up and down linears' inputs were kept for them alone (e -> 1 byte); the
    attention's output stays saved by the attention, so the out linear's 1-byte copy is extra. `rowwise` saves the
    input as it is (no change). `attention` False: the MLP's linears only
    (a linear_attention layer: its projections' FP8 copies are not counted)."""
    if fp8 is None or fp8[0] != "tensorwise":
        return 0.0
    min_dim, e, t = fp8[1], prec.activation, layout.tp
    h, f = dims.hidden_size, dims.ffn
    q, kv = dims.num_heads * dims.hd, dims.kv_heads * dims.hd
    delta = 0.0
    if attention and min(h, q, kv) >= min_dim:
        delta += h * (1 - e)  # qkv's (gathered) input
    if attention and min(q, h) >= min_dim:
        delta += q / t  # out's own copy
    if min(h, f) >= min_dim:
        delta += h * (1 - e)  # up's (gathered) input
    if min(f, h) >= min_dim:
        delta += f / t * (1 - e)  # down's input
    return delta


def layer_activation_bytes(dims: ModelDims, layout: Layout, prec: Precision,
                           fp8: tuple[str, int] | None = None, linear: bool = False) -> float:
    """Bytes one transformer layer saves for its backward per micro-batch, as megalite's block saves them, per token
    (t = tp; hs = h/t under SP, else h: the sequence-sharded tensors; column linears save their gathered input, h):

      llama  norm1 input hs, qkv input h, q/k/v (a + 2·kv)·d/t, attention output a·d/t, residual sum hs,
             up input h, gate and up 2f/t, silu(gate) f/t, down input f/t;  + the log-sum-exp a/t in fp32
      gpt2   the same with LayerNorm, GeLU (up output f/t, down input f/t) instead of SwiGLU

    and in fp32: the attention's log-sum-exp a/t per token, the norms' statistics per sequence-local token (two
    RMSNorms: a 1/rms each; two LayerNorms: a mean and a 1/std each), and (llama) RoPE's cos and sin expanded to
    [S/cp, d] once per layer, whatever the batch and tp (megalite/model/ops.py's `apply_rope`).
    Full recompute keeps the layer input only (hs). `tests/test_memory_terms.py` holds this equal to the bytes
    autograd saves. `linear`: a linear_attention layer, whose Gated DeltaNet saves `recurrent.costs.saved_bytes`
    (the Triton kernel path; this rank's heads, the whole sequence: the column linear gathers it) in place of the
    attention's tensors, RoPE's tables and log-sum-exp."""
    t, e = layout.tp, prec.activation
    h, d, a, kv = dims.hidden_size, dims.hd, dims.num_heads, dims.kv_heads
    s_local = layout.local_seq_len(dims.seq_len)
    tokens = layout.micro_batch_size * s_local
    hs = h / t if layout.sp else h
    if layout.recompute == "full":
        return tokens * hs * e
    llama = dims.arch == "llama"
    mlp = (4 if llama else 2) * dims.ffn / t
    norm_stats = (2 if llama else 4) * (tokens / t if layout.sp else tokens)
    rd = recurrent_dims(dims)
    if linear and rd is not None:
        return (tokens * ((2 * hs + h + mlp) * e + fp8_saved_delta(dims, layout, prec, fp8, attention=False))
                + norm_stats * 4 + gdn_saved_bytes(rd.split(t), layout.micro_batch_size, s_local, h, e, LINEAR_CHUNK))
    per_token = 2 * hs + 2 * h + (2 * a + 2 * kv) * d / t + mlp
    rope = 2 * s_local * d if llama else 0
    # Selective recompute checkpoints the attention core where it is SDPA (cp = 1 or a2a): its log-sum-exp is not kept.
    lse = 0.0 if uses_torch_checkpoint(layout) else a / t * 4
    return (tokens * (per_token * e + lse + fp8_saved_delta(dims, layout, prec, fp8)) + (norm_stats + rope) * 4
            + cp_saved_bytes(dims, layout, prec))


def cp_saved_bytes(dims: ModelDims, layout: Layout, prec: Precision) -> float:
    """What a layer's attention saves under context parallelism beyond the same tensors of its S/cp tokens
    (megalite/context/): the ring keeps its own q, k, v, output and log-sum-exp (nothing more); the all-gather keeps
    the gathered K/V, (cp - 1) x its own, and the queries' and keys' positions (int64, S/cp + S); the all-to-all
    (a2a, and hybrid's all-to-all over cp_a2a ranks) keeps the attention's output before it is sent back beside the
    copy the out linear keeps, and the gathered order and its inverse (int64, cp_a2a x S/cp each). Under selective
    recompute the a2a core is checkpointed: its output is not kept."""
    cp, t, e = layout.cp, layout.tp, prec.activation
    if cp == 1 or layout.recompute == "full":
        return 0.0
    s_local = layout.local_seq_len(dims.seq_len)
    tokens = layout.micro_batch_size * s_local
    if layout.cp_mode == "allgather":
        return (cp - 1) * tokens * 2 * dims.kv_heads * dims.hd / t * e + (s_local + dims.seq_len) * 8
    degree = cp if layout.cp_mode == "a2a" else layout.cp_a2a if layout.cp_mode == "hybrid" else 1
    if degree == 1:
        return 0.0
    out = 0.0 if layout.recompute == "selective" else tokens * dims.num_heads * dims.hd / t * e
    return out + 2 * degree * s_local * 8


def moe_layer_extra_bytes(dims: ModelDims, layout: Layout, prec: Precision) -> float:
    """What a MoE layer saves beyond the dense layer of `layer_activation_bytes`, per micro-batch: its MLP terms
    (4f/t, gpt2 2f/t per token) replaced by the shared experts' (the same with n_s·F_s), and per token the rank
    routes (its S/cp, /t under SP) k dispatched rows, each saving its input, the expert's output and its weighted
    copy (3h) and the expert's intermediates (llama 4F, gpt2 2F), in the run dtype, plus its routing weight (fp32)
    and its two sort indices and top-k index (int64); per routed token the router's logits and probabilities (2E),
    its k weights and two per-token loss statistics (fp32); per layer the experts' counts and loads (3E x 4 B)."""
    moe = dims.moe
    if moe is None or layout.recompute == "full":
        return 0.0
    t, e = layout.tp, prec.activation
    width = 4 if dims.arch == "llama" else 2
    tokens = layout.micro_batch_size * layout.local_seq_len(dims.seq_len)
    routed = tokens / t if layout.sp else tokens
    per_token = width * (moe.shared * moe.shared_ffn - dims.ffn) / t
    per_row = (3 * dims.hidden_size + width * moe.ffn) * e + 4 + 3 * 8
    per_routed = moe.top_k * per_row + (2 * moe.experts + moe.top_k + 2) * 4
    return tokens * per_token * e + routed * per_routed + 3 * moe.experts * 4


def uses_torch_checkpoint(layout: Layout) -> bool:
    """Whether the run calls torch.utils.checkpoint (so imports torch._dynamo): full recompute checkpoints every block
    (megalite/model/gpt.py); selective recompute the attention core, which cp's ring, all-gather and hybrid modes
    replace by their own block pairs (they keep no scores to drop: megalite/model/block.py), a2a does not."""
    selective = layout.recompute == "selective" and (layout.cp == 1 or layout.cp_mode == "a2a")
    return layout.recompute == "full" or selective
