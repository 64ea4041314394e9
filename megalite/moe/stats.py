"""What a step's MoE layers did, for metrics.jsonl, and DeepSeek-V3's auxiliary-loss-free bias update.

Each layer records, per training micro-batch, its assignment counts per expert (this rank's tokens),
dropped assignments, and the micro-batch's balance and z-loss values. At the end of the step
`step_metrics.finish_step` sums them over every rank that saw other tokens (dp x cp, and tp under SP; filed under
'metrics'), nudges each DeepSeek router's bias by bias_rate * sign(mean load - load) on the global
counts (DeepSeek-V3 section 2.1.2: the same update on every rank), and resets.
"""

from __future__ import annotations


import torch

from megalite.torch_private import in_backward


class LayerStats:
    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.experts, dtype=torch.float64)
        self.dropped, self.aux, self.z, self.micro = 0, 0.0, 0.0, 0
        self.a2a_rows: list[int] = []  # per forward: rows sent to + received from the other ep ranks

    def record_exchange(self, off_rank_rows: int) -> None:
        if not in_backward():  # not a full-recompute forward inside the backward
            self.a2a_rows.append(off_rank_rows)

    def record(self, counts: torch.Tensor, dropped: int, aux: float, z: float) -> None:
        # A full-recompute forward (run again inside the backward) is not counted twice.
        if in_backward():
            return
        self.counts += counts.detach().cpu()
        self.dropped += dropped
        self.aux += aux
        self.z += z
        self.micro += 1
