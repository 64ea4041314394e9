"""DeepSeek-V3's auxiliary-loss-free load balancing (Liu et al. 2024, section 2.1.2): after each optimizer
step, every DeepSeek router's selection bias moves by bias_rate x sign(mean load - load), on the step's
global loads (the assignment counts summed over every rank that routed other tokens: dp x cp, and tp under
SP), so every rank applies the same update and the biases stay equal. The bias only chooses experts, it never
weighs them (`router.Router`), and no gradient reaches it: this update is its whole training.

`training.step.train_step` calls `update_router_biases` by name after the optimizer step, and not when the
step is skipped (inf/nan gradients: the step's loads are dropped with it). The step's metrics
(`step_metrics.moe_step_metrics`) only read the same records afterwards.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.moe.layer import MoELayer, moe_layers_of
from megalite.parallel import comm
from megalite.parallel.state import ParallelState


def biased_layers(chunks: list[nn.Module]) -> list[MoELayer]:
    """This rank's MoE layers whose router bias is trained: DeepSeek routers with a non-zero bias_rate."""
    return [m for _, m in moe_layers_of(chunks) if m.s.router == "deepseek" and m.s.bias_rate]


@torch.no_grad()
def update_router_biases(chunks: list[nn.Module], state: ParallelState) -> None:
    """One bias update of every DeepSeek router on this rank, from the step's recorded loads. One all-reduce of
    [layers, E] counts over the ranks that saw other tokens (filed under 'metrics' with the step's other
    bookkeeping, so 'dp' holds exactly the gradient traffic); nothing for a model without such a router."""
    layers = biased_layers(chunks)
    if not layers:
        return
    counts = torch.stack([m.stats.counts for m in layers]).to(state.device)
    if state.sp:
        comm.all_reduce(counts, state, "tp", count_as="metrics")
    comm.all_reduce(counts, state, "dp_cp", count_as="metrics")
    for m, load in zip(layers, counts.cpu()):
        m.router.bias += m.s.bias_rate * torch.sign(load.mean() - load).to(m.router.bias)
