"""What a step's MoE layers did, for metrics.jsonl, and DeepSeek-V3's auxiliary-loss-free bias update.

Each layer records, per training micro-batch, its assignment counts per expert (this rank's tokens),
dropped assignments, and the micro-batch's balance and z-loss values. At the end of the step
`finish_step` sums them over every rank that saw other tokens (dp x cp, and tp under SP; filed under
'metrics'), nudges each DeepSeek router's bias by bias_rate * sign(mean load - load) on the global
counts (DeepSeek-V3 section 2.1.2: the same update on every rank), and resets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from megalite.parallel import comm
from megalite.parallel.state import ParallelState

if TYPE_CHECKING:
    from megalite.moe.layer import MoELayer


class LayerStats:
    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.experts, dtype=torch.float64)
        self.dropped, self.aux, self.z, self.micro = 0, 0.0, 0.0, 0
        self.a2a_rows: list[int] = []  # per forward: rows sent to + received from the other ep ranks

    def record_exchange(self, off_rank_rows: int) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a full-recompute forward inside the backward
            self.a2a_rows.append(off_rank_rows)

    def record(self, counts: torch.Tensor, dropped: int, aux: float, z: float) -> None:
        # A full-recompute forward (run again inside the backward) is not counted twice.
        if torch._C._current_graph_task_id() != -1:
            return
        self.counts += counts.detach().cpu()
        self.dropped += dropped
        self.aux += aux
        self.z += z
        self.micro += 1


def moe_layers_of(chunks: list[nn.Module]) -> list[tuple[str, MoELayer]]:
    """(global layer name, MoELayer) of every MoE layer on this rank, in model order."""
    from megalite.moe.layer import MoELayer

    out: list[tuple[str, MoELayer]] = []
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, MoELayer):
                out.append((name.removeprefix("0.").removesuffix(".mlp"), m))
    return out


def finish_step(chunks: list[nn.Module], state: ParallelState, update_bias: bool = True) -> dict[str, Any] | None:
    """The step's MoE metrics (None without MoE layers on any rank of the pipeline is not known here:
    None when this rank has none), after the global bias update; resets the layers' records."""
    layers = moe_layers_of(chunks)
    if not layers:
        return None
    e = layers[0][1].s.experts
    table = torch.stack([torch.cat([m.stats.counts, torch.tensor([m.stats.dropped, m.stats.aux, m.stats.z,
                                                                      m.stats.micro], dtype=torch.float64)])
                         for _, m in layers]).to(state.device)
    if state.sp:
        table[:, :e + 1] = comm.all_reduce(table[:, :e + 1].contiguous(), state, "tp", count_as="metrics")
    comm.all_reduce(table, state, "dp_cp", count_as="metrics")
    out: dict[str, Any] = {"aux_loss": {}, "z_loss": {}, "dropped_tokens": {}, "load_max": {}, "load_mean": {},
                           "a2a_rows": {}, "a2a_calls": {}}
    for (name, m), row in zip(layers, table.cpu()):
        counts, micro = row[:e], max(1.0, float(row[e + 3]))
        out["aux_loss"][name] = float(row[e + 1]) / micro
        out["z_loss"][name] = float(row[e + 2]) / micro
        out["dropped_tokens"][name] = int(row[e])
        out["load_max"][name] = float(counts.max())
        out["load_mean"][name] = float(counts.mean())
        # This rank's own exchange (not reduced): rows sent to + received from the other ep ranks, per forward.
        out["a2a_rows"][name] = sum(m.stats.a2a_rows)
        out["a2a_calls"][name] = len(m.stats.a2a_rows)
        if update_bias and m.s.router == "deepseek" and m.s.bias_rate and m.training:
            with torch.no_grad():
                m.router.bias += m.s.bias_rate * torch.sign(counts.mean() - counts).to(m.router.bias)
        m.stats.reset()
    return out
