"""Multi-token prediction in the estimator: the formulas are `megalite.mtp.costs`'; this file feeds them a model
config's block sizes (a MoE block's total and active parameters from `perfmodel.moe`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megalite.model.spec import head_dim
from megalite.mtp.costs import mtp_flops_per_token, mtp_params
from megalite.perfmodel.moe import moe_param_counts


@dataclass(frozen=True)
class MTPCosts:
    params: int            # the modules' own parameters
    active: int            # those a token uses
    flops_per_token: float  # training FLOPs per token of the modules and their logits
    flops_per_token_causal: float  # the same with the causal-halved attention count


def mtp_costs(m: Any, depth: int) -> MTPCosts:
    """The D modules of model config `m` (resolved): their blocks are global layers num_layers .. + D - 1, so a
    MoE model's MTP block is MoE where `moe_first_dense` / `moe_every` say so, as the model builds it."""
    if depth <= 0:
        return MTPCosts(0, 0, 0.0, 0.0)
    more = copy.copy(m)
    more.num_layers = m.num_layers + depth
    with_blocks, base = moe_param_counts(more), moe_param_counts(m)
    blocks, blocks_active = with_blocks.total - base.total, with_blocks.active - base.active
    h = m.hidden_size
    attn = m.num_heads * head_dim(m)
    total = mtp_params(depth, h, blocks // depth)
    active = mtp_params(depth, h, blocks_active // depth)
    flops = [mtp_flops_per_token(depth, h, m.vocab_size, blocks_active // depth, attn, m.seq_len, causal)
             for causal in (False, True)]
    return MTPCosts(total, active, *flops)
