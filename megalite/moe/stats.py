"""What a step's MoE layers did: per training micro-batch, each layer's assignment counts per expert (this
rank's tokens), dropped assignments, and the micro-batch's router loss values (`losses.router_losses`
computes them; this file only keeps them). Two readers at the end of the step, in this order: the router
bias update (`balance.update_router_biases`, after the optimizer step) and the step's metrics
(`step_metrics.moe_step_metrics`, which then resets the records)."""

from __future__ import annotations

import torch

from megalite.moe.losses import RouterLosses
from megalite.torch_private import in_backward


class LayerStats:
    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.experts, dtype=torch.float64)
        self.dropped, self.aux, self.seq_aux, self.z, self.micro = 0, 0.0, 0.0, 0.0, 0
        self.a2a_rows: list[int] = []  # per forward: rows sent to + received from the other ep ranks

    def record_exchange(self, off_rank_rows: int) -> None:
        if not in_backward():  # not a full-recompute forward inside the backward
            self.a2a_rows.append(off_rank_rows)

    def record(self, losses: RouterLosses, dropped: int) -> None:
        # A full-recompute forward (run again inside the backward) is not counted twice.
        if in_backward():
            return
        self.counts += losses.counts.detach().cpu()
        self.dropped += dropped
        self.aux += losses.aux
        self.seq_aux += losses.seq_aux
        self.z += losses.z
        self.micro += 1
