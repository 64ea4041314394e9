"""Router losses, each computed in this one file, and how they reach the backward without touching the model's loss.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4; GShard, Lepikhin et al. 2020):
    aux = E * sum_i f_i * P_i,  f_i = (assignments to expert i) / T,  P_i = (sum over tokens of p_i) / T
over the micro-batch's T tokens (f sums to k: transformers' `load_balancing_loss_func` form). DeepSeek-V3's
sequence-wise balance loss (Liu et al. 2024, eq. 17-20) is the same product per sequence, with
f_i = E / (k T_s) * (assignments to i in the sequence) and P_i the mean normalised score over its T_s tokens:
    seq_aux = mean over the sequences of (1/k) * E * sum_i (c_i / T_s) (P_i)
Router z-loss (ST-MoE, Zoph et al. 2022): z = mean over tokens of logsumexp(logits)^2. Each is multiplied by its
coefficient and averaged over the MoE layers.

All are over the micro-batch's tokens whatever the layout: under SP (tokens split over tp) and CP
(split over cp) the assignment counts and the probability sums are summed over those ranks first (one
all-reduce, no gradient), which gives each loss's value; each rank differentiates only its own tokens' share
(the same formula with its local probability sums, linear in them), so the shares add up to the whole. Under
CP the training step divides every gradient by cp once more than the shares need (each cp rank's token loss is
a mean over its own S/cp tokens), so the share is multiplied by cp; under SP the router's gradient is an SP
partial sum (summed over tp).

The share reaches the backward like Megatron's `MoEAuxLossAutoScaler`: an identity on the layer's
output whose backward also returns d(aux) = the scale the training step gives its loss (loss scale / M,
set on the model before each micro-batch: `ScalesAuxLoss`), so pipeline stages need not ship it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megalite.parallel import comm
from megalite.parallel.state import ParallelState


@runtime_checkable
class ScalesAuxLoss(Protocol):
    """A model chunk with auxiliary losses: told the factor on its micro-batch's loss before each forward."""

    def set_aux_loss_scale(self, scale: float) -> None: ...


class AuxScale:
    """The factor the current micro-batch's loss is backpropagated with (1 outside the training step)."""

    def __init__(self) -> None:
        self.value = 1.0


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=g.device), None


def attach(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """x, with `aux` (a scalar) added to what the backward minimises, times `scale`."""
    return _Attach.apply(x, aux, scale)


def balance(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int) -> torch.Tensor:
    """E * sum_i (counts_i / T) (prob_sums_i / T) over the last dim [.., E]: the micro-batch's (or each
    sequence's) balance loss from global counts and global probability sums, or this rank's differentiable share
    of it from its local probability sums (the formula is linear in them)."""
    e = counts.shape[-1]
    return e * (counts / tokens * prob_sums / tokens).sum(-1)


@dataclass(frozen=True)
class LossCoefficients:
    """The router losses' coefficients (`moe.aux_loss`, `moe_seq_aux_loss`, `moe_z_loss`) and the
    experts per token (the sequence-wise loss divides by k)."""

    aux: float
    seq_aux: float
    z: float
    top_k: int


@dataclass(frozen=True)
class RouterLosses:
    """One micro-batch's router losses: their values (global over the ranks that split its tokens, for
    metrics) and this rank's differentiable share of coef x loss (None when every coefficient is 0)."""

    counts: torch.Tensor        # [E] this rank's assignment counts (float64, no gradient)
    aux: float
    seq_aux: float
    z: float
    share: torch.Tensor | None


def router_losses(experts: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor, sequences: int,
                  coef: LossCoefficients, state: ParallelState) -> RouterLosses:
    """experts [T, k], probs / logits [T, E] of this rank's T tokens, `sequences` rows of T / sequences tokens
    each (the micro-batch's sequences, or their slices under SP / CP)."""
    e = probs.shape[1]
    chosen = experts.reshape(sequences, -1)                                  # [B, T/B * k]
    per_seq_counts = torch.zeros(sequences, e, dtype=torch.float64, device=experts.device)
    per_seq_counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float64))
    local_probs = probs.reshape(sequences, -1, e).sum(1)                     # [B, E], differentiable
    lse_sq = torch.logsumexp(logits, dim=-1).pow(2).sum()                    # differentiable
    # Summed over the ranks that split the micro-batch's tokens: every sequence's counts and sums, whole.
    stat = torch.cat([per_seq_counts, local_probs.detach().double(), lse_sq.detach().double().reshape(1, 1)
                      .expand(sequences, 1)], dim=1)
    if state.sp:
        comm.all_reduce(stat, state, "tp", count_as="metrics")
    comm.all_reduce(stat, state, "cp", count_as="metrics")
    per_seq = experts.shape[0] // sequences * (state.tp if state.sp else 1) * state.cp  # T_s: a whole sequence
    tokens = per_seq * sequences
    counts_b, probs_b, lse_total = stat[:, :e], stat[:, e:2 * e], stat[0, 2 * e]
    counts = counts_b.sum(0)
    aux = balance(counts, probs_b.sum(0), tokens)
    seq_aux = balance(counts_b, probs_b, per_seq).mean() / coef.top_k
    z = lse_total / tokens
    share: torch.Tensor | None = None
    if coef.aux or coef.seq_aux or coef.z:
        share = local_probs.new_zeros(())
        if coef.aux:
            share = share + coef.aux * balance(counts.float(), local_probs.sum(0), tokens)
        if coef.seq_aux:
            share = share + coef.seq_aux * balance(counts_b.float(), local_probs, per_seq).mean() / coef.top_k
        if coef.z:
            share = share + coef.z * lse_sq / tokens
        share = share * state.cp
    return RouterLosses(per_seq_counts.sum(0), float(aux), float(seq_aux), float(z), share)
