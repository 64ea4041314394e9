"""What multi-token prediction costs, torch-free (`megalite.perfmodel` reads these; docs/mtp.md).

Per depth k (D of them), with h the width, V the vocabulary, s the sequence length, T the tokens of a micro-batch
on a rank, `block` / `block_active` one transformer block's total / per-token parameters (a MoE block's active
ones count its router, its k experts and the shared ones):

  parameters   block + 2 h^2 (eh_proj) + 3 h (enorm, hnorm, the head's norm); the embedding and the head are
               shared (under pipeline parallelism the last stage also holds a V x h copy of the embedding:
               `stage_copy_params`)
  FLOPs/token  6 (block_active + 2 h^2) + 12 h_attn s (the block, as PaLM's 6N + 12 L h s)
               + 6 h V (the shared head runs once more per depth)
  activations  the block's, plus [T, 2h] (the concatenation) and [T, h] (the embedding) in the run dtype and the
               depth's fp32 logits [T, V/tp] kept for the cross-entropy's backward, per micro-batch in flight
               on the last stage (`perfmodel.activations`, which the estimate and the memory check both read)
"""

from __future__ import annotations


def mtp_params(depth: int, hidden: int, block: int) -> int:
    """The MTP modules' own parameters (the shared embedding and head not counted again)."""
    return depth * (block + 2 * hidden * hidden + 3 * hidden)


def stage_copy_params(depth: int, pp: int, tied: bool, vocab: int, hidden: int) -> int:
    """Parameters the last pipeline stage holds beyond its own: the embedding's copy the modules read (none at
    pp = 1, none when the tied head already is that copy)."""
    return vocab * hidden if depth and pp > 1 and not tied else 0


def mtp_flops_per_token(depth: int, hidden: int, vocab: int, block_active: int, attn_width: int,
                        seq_len: int, causal: bool = False) -> float:
    """Training (forward + backward) FLOPs per token of the D modules and their logits, recompute not counted;
    `causal` halves the attention term as `perfmodel.flops.model_flops_per_token` does."""
    attention = (6 if causal else 12) * attn_width * seq_len
    per_depth = 6 * (block_active + 2 * hidden * hidden) + attention + 6 * hidden * vocab
    return float(depth * per_depth)


def mtp_activation_bytes(depth: int, tokens: int, hidden: int, vocab_per_rank: int, bytes_per_element: float,
                         block_bytes: float) -> float:
    """Bytes the D modules keep for the backward per micro-batch on the last stage, `block_bytes` being one
    block's activations there."""
    return depth * (block_bytes + tokens * 3 * hidden * bytes_per_element + tokens * vocab_per_rank * 4.0)
