"""The step's multi-token prediction losses for metrics.jsonl (`mtp_loss`: one mean per depth), read from the
modules' records, which are then reset. Every rank returns the same list: the last stage's numbers summed over
pp (the other stages add zeros) and averaged over dp x cp."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from megalite.mtp.module import MultiTokenPrediction
from megalite.parallel import comm
from megalite.parallel.state import ParallelState


@runtime_checkable
class PredictsTokensAhead(Protocol):
    """A model chunk that knows the model's MTP depth (0: none), on every stage."""

    @property
    def mtp_depth(self) -> int: ...


def mtp_step_metrics(chunks: list[nn.Module], state: ParallelState) -> list[float] | None:
    """Each depth's mean loss over the step's micro-batches and ranks (None without MTP)."""
    depth = max((c.mtp_depth for c in chunks if isinstance(c, PredictsTokensAhead)), default=0)
    if not depth:
        return None
    table = torch.zeros(depth + 1, dtype=torch.float64)
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, MultiTokenPrediction):
                table += torch.tensor([*m.sums, m.micro], dtype=torch.float64)
                m.reset()
    table = table.to(state.device)
    comm.all_reduce(table, state, "pp", count_as="metrics")
    comm.all_reduce(table, state, "dp_cp", count_as="metrics")
    table = table.cpu()
    return (table[:depth] / table[depth].clamp(min=1)).tolist()
