"""The step's MoE metrics (metrics.jsonl's `moe`): the layers' loads and router losses summed over the ranks,
read from the per-layer records (`stats.LayerStats`), which are then reset for the next step. Reading only:
DeepSeek-V3's bias update is `balance.update_router_biases`, which the step calls before this.
Under pipeline parallelism every stage ends with every MoE layer's numbers, its own and the other stages'
(`_over_stages`), so rank 0, which writes metrics.jsonl, reports all of them."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from megalite.moe.layer import moe_layers_of
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

FIELDS = ("aux_loss", "seq_aux_loss", "z_loss", "dropped_tokens", "load_max", "load_mean", "a2a_rows", "a2a_calls")
_COUNTS = {"dropped_tokens", "a2a_rows", "a2a_calls"}


@runtime_checkable
class NamesMoELayers(Protocol):
    """A model chunk that names every MoE layer of the whole model (megalite.model.gpt.GPT: its layers' and its
    MTP modules' blocks'), so any stage can report every MoE layer of the model, its own or not."""

    def moe_layer_names(self) -> list[str]: ...


def all_moe_layer_names(chunks: list[nn.Module]) -> list[str]:
    """The names ("layers.i", "mtp.layers.k.block") of every MoE layer of the model, on every stage (empty for a
    dense model)."""
    for chunk in chunks:
        if isinstance(chunk, NamesMoELayers):
            return chunk.moe_layer_names()
    return [name for name, _ in moe_layers_of(chunks)]


def moe_step_metrics(chunks: list[nn.Module], state: ParallelState) -> dict[str, Any] | None:
    """The step's MoE metrics of every MoE layer of the model (None for a dense one); resets the layers'
    records for the next step."""
    names = all_moe_layer_names(chunks) if state.pp > 1 else []
    local = _finish_local(chunks, state)
    return _over_stages(local, names, state) if names else local


def _over_stages(local: dict[str, Any] | None, names: list[str], state: ParallelState) -> dict[str, Any]:
    """Every stage's layers (each filled by the stage that holds it, 0 elsewhere, summed over pp: exact in
    float64). `a2a_rows` / `a2a_calls` of another stage's layer are that stage's rank in this rank's pipeline
    column (same tp, cp and dp coordinates)."""
    table = torch.zeros(len(names), len(FIELDS), dtype=torch.float64)
    for i, name in enumerate(names):
        if local is not None and name in local["aux_loss"]:
            table[i] = torch.tensor([float(local[f][name]) for f in FIELDS], dtype=torch.float64)
    table = comm.all_reduce(table.to(state.device), state, "pp", count_as="metrics").cpu()
    return {f: {n: (int(v) if f in _COUNTS else float(v)) for n, v in zip(names, table[:, j].tolist())}
            for j, f in enumerate(FIELDS)}


def _finish_local(chunks: list[nn.Module], state: ParallelState) -> dict[str, Any] | None:
    """This stage's MoE layers' metrics (None when it has none)."""
    layers = moe_layers_of(chunks)
    if not layers:
        return None
    e = layers[0][1].s.experts
    table = torch.stack([torch.cat([m.stats.counts, torch.tensor([m.stats.dropped, m.stats.aux, m.stats.seq_aux,
                                                                      m.stats.z, m.stats.micro], dtype=torch.float64)])
                         for _, m in layers]).to(state.device)
    if state.sp:
        table[:, :e + 1] = comm.all_reduce(table[:, :e + 1].contiguous(), state, "tp", count_as="metrics")
    comm.all_reduce(table, state, "dp_cp", count_as="metrics")
    out: dict[str, Any] = {f: {} for f in FIELDS}
    for (name, m), row in zip(layers, table.cpu()):
        counts, micro = row[:e], max(1.0, float(row[e + 4]))
        out["aux_loss"][name] = float(row[e + 1]) / micro
        out["seq_aux_loss"][name] = float(row[e + 2]) / micro
        out["z_loss"][name] = float(row[e + 3]) / micro
        out["dropped_tokens"][name] = int(row[e])
        out["load_max"][name] = float(counts.max())
        out["load_mean"][name] = float(counts.mean())
        # This rank's own exchange (not reduced): rows sent to + received from the other ep ranks, per forward.
        out["a2a_rows"][name] = sum(m.stats.a2a_rows)
        out["a2a_calls"][name] = len(m.stats.a2a_rows)
        m.stats.reset()
    return out
