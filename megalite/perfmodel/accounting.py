"""Exact bytes megalite's tensor-parallel layers move, in the counter's convention (wire bytes per
rank; see `megalite.parallel.counter`). The tests hold the measured counts equal to these.

Per micro-batch of b sequences of s tokens, hidden h, activation element size e, X = b*s*h*e:
  each transformer layer: 2 all-reduces forward (after attention-out and MLP-down, Megatron's g)
  and 2 backward (before qkv and up, Megatron's f): 4 * 2(t-1)/t * X;
  the embedding: 1 all-reduce forward; the head: 1 all-reduce backward (its f);
  the vocab-parallel loss: all-reduce of the row max (b*s fp32) and of (sum-exp, target logit)
  (2*b*s fp32).
With SP every all-reduce of X becomes an all-gather plus a reduce-scatter of X ((t-1)/t each): the
same volume. SP adds, once per step, an all-reduce over TP of the replicated parameters' partial
gradients (norm weights and biases, row-parallel biases, learned positions), in fp32.
"""

from __future__ import annotations

from fractions import Fraction

from megalite.perfmodel.inputs import Layout


def tp_bytes_per_micro_batch(num_layers: int, hidden: int, micro_batch: int, seq_len: int, tp: int,
                             act_bytes: int) -> Fraction:
    if tp == 1:
        return Fraction(0)
    ring = Fraction(2 * (tp - 1), tp)
    x = micro_batch * seq_len * hidden * act_bytes
    tokens = micro_batch * seq_len
    return ring * (4 * num_layers * x + 2 * x + 3 * tokens * 4)


def sp_partial_grad_elements(arch: str, num_layers: int, hidden: int, seq_len: int) -> int:
    """Elements of the replicated parameters whose grads SP leaves partial (all-reduced over TP)."""
    norms = 2 * num_layers + 1
    if arch == "llama":
        return norms * hidden
    return norms * 2 * hidden + 2 * num_layers * hidden + seq_len * hidden  # + row biases, positions


def tp_bytes_per_step(arch: str, num_layers: int, hidden: int, seq_len: int, layout: Layout, micro_batches: int,
                      act_bytes: int) -> Fraction:
    """TP wire bytes one rank moves in one optimizer step (forward + backward + SP grad sync) at `layout`'s tp,
    sp and micro-batch size."""
    tp, sp, micro_batch = layout.tp, layout.sp, layout.micro_batch_size
    total = micro_batches * tp_bytes_per_micro_batch(num_layers, hidden, micro_batch, seq_len, tp, act_bytes)
    if sp and tp > 1:
        total += Fraction(2 * (tp - 1), tp) * sp_partial_grad_elements(arch, num_layers, hidden, seq_len) * 4
    return total
