"""What the gated delta rule costs, in closed form (torch-free: the estimator and planner read these).

Per sequence of S tokens, H value heads of key width K and value width V, chunks of C (N = ceil(S / C) chunks,
the last one zero-padded, as the chunked form runs it):

    matmuls per chunk and head       4 C^2 K   (beta k k^T and q k^T, each [C, K] x [K, C])
                                   + 2 C^2 V   ((q k^T D) V')
                                   + 6 C K V   (W S, q S and k^T V': the state's reads and its update)
    triangular solve per chunk/head  C (C - 1) (K + V)      (I + A) U = beta v and (I + A) W = beta k e^cum,
                                                             by forward substitution: C (C - 1) / 2 multiply-adds
                                                             per right-hand column
    elementwise (decays, masks)      not counted, as the estimator counts no norm or activation

Generation keeps, per sequence and layer, the state [H, K, V] and the conv window [W - 1, channels]: constant in
the number of tokens, where a full-attention layer's KV cache grows with it.

The layer around the recurrence (megalite/recurrent/gated_deltanet.py) adds its weights: in_proj [h, C + H V + 2 H]
(q, k, v for the conv's C = 2 Hk K + H V channels, then z, b and a), out_proj [H V, h], the depthwise conv [C, W]
(one multiply-add per weight and token, like a matmul's), and A_log, dt_bias [H], norm_weight [V] (elementwise).

Context parallelism by state passing (megalite/recurrent/state_passing.py): each cp rank sends the affine map of
each of its slices, S_out = M S_in + B, as one [H, K, K + V] tensor per sequence (fp32); an all-gather over cp
brings the other ranks' (forward) and a reduce-scatter of the same size carries their gradients back:
independent of S. The conv's halo (each slice's last W - 1 inputs) is all-gathered the same way.
`cp_state_passing_bytes` is one layer's whole cp traffic per micro-batch, as the counter files it under 'cp' in a
model (megalite's zigzag split: two slices per rank); full recompute re-runs the forward's half.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.context.costs import CpBytes

FP32 = 4


@dataclass(frozen=True)
class RecurrentDims:
    """One linear layer's recurrence: value heads, key and value widths, the conv's channels and kernel."""

    heads: int
    key_dim: int
    value_dim: int
    conv_channels: int
    conv_kernel: int = 4
    key_heads: int = 0  # query/key heads Hk (0: = heads); the conv's channels are 2 Hk K + H V

    @property
    def k_heads(self) -> int:
        return self.key_heads or self.heads

    def split(self, tp: int) -> "RecurrentDims":
        """One tensor-parallel rank's share: whole heads (key heads with the value heads that read them), the conv's
        channels with them (megalite/recurrent/gated_deltanet.py)."""
        return RecurrentDims(self.heads // tp, self.key_dim, self.value_dim, self.conv_channels // tp,
                             self.conv_kernel, self.k_heads // tp)


def chunks(seq: int, chunk: int) -> int:
    return -(-seq // chunk)


def chunked_matmul_flops(d: RecurrentDims, batch: int, seq: int, chunk: int) -> int:
    """The chunked form's matrix products, forward, per layer (the count torch's FLOP counter makes)."""
    c, k, v = chunk, d.key_dim, d.value_dim
    return batch * d.heads * chunks(seq, chunk) * (4 * c * c * k + 2 * c * c * v + 6 * c * k * v)


def triangular_solve_flops(d: RecurrentDims, batch: int, seq: int, chunk: int) -> int:
    """The two triangular solves per chunk (U and W), forward, per layer."""
    return batch * d.heads * chunks(seq, chunk) * chunk * (chunk - 1) * (d.key_dim + d.value_dim)


def chunked_flops(d: RecurrentDims, batch: int, seq: int, chunk: int) -> int:
    """The recurrence's forward FLOPs by chunks, per layer (its projections are ordinary linears, priced apart)."""
    return chunked_matmul_flops(d, batch, seq, chunk) + triangular_solve_flops(d, batch, seq, chunk)


def ssd_chunked_flops(d: RecurrentDims, batch: int, seq: int, chunk: int) -> int:
    """The chunked form without the erase (Mamba2's SSD, erase=False), forward, per layer: q k^T (2 C^2 K), its
    product with the values (2 C^2 V), the state's read q S and update k^T V' (4 C K V); no triangular solve
    (`key_dim` is the state size N, `value_dim` the head width P)."""
    c, k, v = chunk, d.key_dim, d.value_dim
    return batch * d.heads * chunks(seq, chunk) * (2 * c * c * k + 2 * c * c * v + 4 * c * k * v)


def recurrent_flops(d: RecurrentDims, batch: int, seq: int) -> int:
    """Token by token, for comparison: per token and head the decay (K V), the read S^T k (2 K V), the write
    (2 K V) and the output S^T q (2 K V): linear in S with no C^2 term, but S sequential steps."""
    return batch * d.heads * seq * 7 * d.key_dim * d.value_dim


def state_bytes(d: RecurrentDims, batch: int, act_bytes: int, state_bytes_per: int = FP32) -> int:
    """The generation cache of one layer: the recurrent state (fp32) and the conv window (activation dtype)."""
    return batch * (d.heads * d.key_dim * d.value_dim * state_bytes_per
                    + (d.conv_kernel - 1) * d.conv_channels * act_bytes)


def cp_exchange_bytes(d: RecurrentDims, batch: int, cp: int, slices_per_rank: int = 1) -> int:
    """Ring bytes one rank's counter records for the state-passing exchange of one layer, forward: the all-gather
    of every slice's [B, H, K, K + V] fp32 map, (cp - 1) / cp of them (megalite/parallel/counter.py's convention;
    two slices per rank under the zigzag split); the backward's reduce-scatter records as much again."""
    return (cp - 1) * slices_per_rank * batch * d.heads * d.key_dim * (d.key_dim + d.value_dim) * FP32


def cp_conv_halo_bytes(d: RecurrentDims, batch: int, cp: int, act_bytes: int, slices_per_rank: int = 1) -> int:
    """The conv's halo, forward: the last W - 1 inputs of every slice, all-gathered (backward as much again)."""
    return (cp - 1) * slices_per_rank * batch * (d.conv_kernel - 1) * d.conv_channels * act_bytes


def cp_state_passing_bytes(d: RecurrentDims, batch: int, cp: int, act_bytes: int, slices_per_rank: int = 2
                           ) -> CpBytes:
    """One linear layer's cp traffic per micro-batch (`d` per tp rank): forward the maps' and the halo's
    all-gathers, backward their reduce-scatters, as much again (the zigzag split's two slices per rank by default)."""
    forward = (cp_exchange_bytes(d, batch, cp, slices_per_rank)
               + cp_conv_halo_bytes(d, batch, cp, act_bytes, slices_per_rank))
    return CpBytes(forward, forward)


def matmul_weights(d: RecurrentDims, hidden: int) -> int:
    """The layer's weights used once per token in a multiply-add (2 FLOPs forward each): in_proj, out_proj and the
    depthwise conv's kernel."""
    hv = d.heads * d.value_dim
    return hidden * (d.conv_channels + hv + 2 * d.heads) + hv * hidden + d.conv_channels * d.conv_kernel


def layer_params(d: RecurrentDims, hidden: int) -> int:
    """Every parameter of the layer: `matmul_weights` and A_log, dt_bias [H] and the gated norm's weight [V]."""
    return matmul_weights(d, hidden) + 2 * d.heads + d.value_dim


def saved_bytes(d: RecurrentDims, batch: int, seq: int, hidden: int, act_bytes: int, chunk: int) -> int:
    """Bytes the layer saves for its backward on the Triton kernel path (one micro-batch of `batch` sequences of
    `seq` tokens; `d` one rank's share, `d.split(tp)`; e = act_bytes), per token:

        in_proj's input h e; the conv's W masked shifted inputs W (C e + 1) (their document masks, bool), its output
        and SiLU's C e each; q/k's l2 norms 2 Hk e; the decay's softplus input, output and g H 4 (fp32) and
        beta H e; the kernel's q, k (repeated to the value heads) 2 H K e, v H V e, the document ids 8 (int64);
        the gated RMSNorm's fp32 input, SiLU(z) and z upcast, 3 H V 4, its 1/rms H 4, the normed value, the gated
        product and out_proj's input, 3 H V e;

    per sequence: the state entering each chunk N H K V 4 (fp32, N = ceil(seq / chunk)) and the conv's past
    document mask W - 1 (bool); per micro-batch: exp(A_log) and its negation, 2 H 4. Linear in seq (no seq^2
    term). Equal to autograd's saved tensors in fp32 (tests/test_gdn_estimate.py); the torch chunked form saves
    more (its [C, C] blocks per chunk and head)."""
    e, h, hv, w, c = act_bytes, d.heads, d.heads * d.value_dim, d.conv_kernel, d.conv_channels
    per_token = (hidden * e + w * (c * e + 1) + 2 * c * e + 2 * d.k_heads * e + 3 * h * FP32 + h * e
                 + 2 * h * d.key_dim * e + hv * e + 8 + 3 * hv * FP32 + h * FP32 + 3 * hv * e)
    per_sequence = chunks(seq, chunk) * h * d.key_dim * d.value_dim * FP32 + (w - 1)
    return batch * (seq * per_token + per_sequence) + 2 * h * FP32
