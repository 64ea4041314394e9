"""The end of a training step for the MoE layers: their loads and router losses summed over the ranks
(metrics.jsonl's `moe`) and DeepSeek-V3's bias update (the per-layer records are `stats.LayerStats`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megalite.moe.layer import MoELayer
from megalite.parallel import comm
from megalite.parallel.state import ParallelState


def moe_layers_of(chunks: list[nn.Module]) -> list[tuple[str, MoELayer]]:
    """(global layer name, MoELayer) of every MoE layer on this rank, in model order."""
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
