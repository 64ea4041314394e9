"""Router losses and how they reach the backward without touching the model's loss.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4; GShard, Lepikhin et al. 2020):
    aux = E * sum_i f_i * P_i,  f_i = (assignments to expert i) / T,  P_i = (sum over tokens of p_i) / T
over the micro-batch's T tokens (f sums to k: transformers' `load_balancing_loss_func` form). Router
z-loss (ST-MoE, Zoph et al. 2022): z = mean over tokens of logsumexp(logits)^2. Each is multiplied by its
coefficient and averaged over the MoE layers.

Both are over the micro-batch's tokens whatever the layout: under SP (tokens split over tp) and CP
(split over cp) the assignment counts are summed over those ranks first (`stats` all-reduce, no
gradient), and each rank differentiates only its own tokens' share, sum_{t local} p_t / T, so the
shares add up to the whole. Under CP the training step divides every gradient by cp once more than
the shares need (each cp rank's token loss is a mean over its own S/cp tokens), so the share is
multiplied by cp; under SP the router's gradient is an SP partial sum (summed over tp).

The value reaches the backward like Megatron's `MoEAuxLossAutoScaler`: an identity on the layer's
output whose backward also returns d(aux) = the scale the training step gives its loss (loss scale / M,
set on the model before each micro-batch: `ScalesAuxLoss`), so pipeline stages need not ship it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


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


def balance_share(counts: torch.Tensor, local_prob_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's share of E * sum_i f_i P_i: counts [E] over the micro-batch (no gradient), the local
    tokens' probability sums [E] (differentiable), `tokens` = T of the whole micro-batch."""
    e = counts.numel()
    return e * (counts.float() / tokens * local_prob_sum / tokens).sum()


def z_share(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's share of mean_t logsumexp(logits_t)^2 over the micro-batch's `tokens`."""
    return torch.logsumexp(logits, dim=-1).pow(2).sum() / tokens
