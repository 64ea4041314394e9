"""Vocab-parallel embedding (Megatron-LM section 3): each TP rank holds a contiguous block of rows.

The vocabulary is padded to a multiple of `tp * make_vocab_divisible_by` so every rank holds the
same number of rows (and matmuls get friendly shapes). Padded rows are never looked up (token ids
are < vocab_size), and on the output side `vocab_parallel_cross_entropy` masks them to -inf, so they
never win a softmax and never receive gradient: the model computes the same function at any tp.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.layers.init import full_normal
from megalite.layers.linear import exit_tp_region
from megalite.parallel.param_spec import VOCAB, ParamSpec
from megalite.parallel.state import ParallelState


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int) -> int:
    """Round the vocabulary up to a multiple of tp * divisible_by."""
    multiple = tp * divisible_by
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows split across TP; the partial lookups are summed by an all-reduce
    (or reduce-scattered along the sequence under SP)."""

    def __init__(self, vocab_size: int, padded_size: int, hidden: int, state: ParallelState, *,
                 name: str, seed: int, std: float) -> None:
        super().__init__()
        self.state, self.vocab_size = state, vocab_size
        self.rows = padded_size // state.tp
        self.vocab_start = state.tp_rank * self.rows
        full = full_normal((padded_size, hidden), std, seed, name)
        full[vocab_size:] = 0.0  # padded rows: never used; zero keeps exported weights clean
        self.weight = nn.Parameter(full[self.vocab_start:self.vocab_start + self.rows].contiguous())

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec(VOCAB)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.state)
