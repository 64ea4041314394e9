"""The model's one call into context parallelism: this rank's attention rows by the configured cp mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megalite.attention.blocks import Backend
from megalite.attention.local import variant_attention
from megalite.attention.variant import PLAIN, AttentionVariant, variant_heads
from megalite.context.allgather import allgather_attention
from megalite.context.group import GROUP
from megalite.context.documents import DocumentIds, document_causal_mask
from megalite.context.hybrid import hybrid_attention
from megalite.context.options import ContextOptions
from megalite.context.ring import ring_attention
from megalite.context.a2a import LocalAttention, a2a_attention, head_group
from megalite.parallel.comm import outside_graph
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor
# Runs an attention function on its tensors: directly, or under selective recompute's checkpoint.
Runner = Callable[..., Tensor]


def run_directly(fn: Callable[..., Tensor], *args: object) -> Tensor:
    return fn(*args)


class Attend(Protocol):
    """The model's whole-sequence attention: causal, or under an explicit `keep` [B, 1, S, S] mask."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor: ...


@dataclass(frozen=True)
class Masking:
    """Which keys a query sees and how it weighs them, beyond causality: the packed documents (data.document_mask)
    and the layer's attention variant (window, sinks, soft-cap, scale: megalite/attention/variant.py)."""

    docs: DocumentIds | None = None
    variant: AttentionVariant = PLAIN


@dataclass(frozen=True)
class Local:
    """What this rank computes with: the model's whole-sequence attention (`attend`), the block backend of ring /
    all-gather (torch block math or the flash kernel), and `run`: how the model runs an attention function
    (directly, or under selective recompute's checkpoint)."""

    attend: Attend
    backend: Backend
    run: Runner = run_directly


@outside_graph  # `model.compile`: the ring / gather / all-to-all and their Python-driven overlap stay eager
def context_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, options: ContextOptions,
                      local: Local, masking: Masking = Masking()) -> Tensor:
    """Causal attention of this rank's zigzag-split q/k/v against the whole sequence ([b, S/cp, h, d] in
    and out). ring / allgather compute block pairs on `local.backend` (torch block math or the flash kernel);
    a2a runs `local.attend`, the model's whole-sequence kernel, on its heads/cp. Under document masking (`masking.docs`) the
    ring and all-gather forms add the same-document test to their masks, and a2a runs `attend` under the whole
    sequence's document-causal mask; hybrid all-to-alls inside groups of
    `options.a2a_degree` cp ranks and runs the ring (on `backend`, under the documents) across them.
    `masking.variant` applies in every mode: ring and all-gather put the window in their block masks (the ring
    skips the block pairs wholly outside it and tallies them), the soft-cap in their scores and the sinks once
    per row after merging; a2a runs the variant's whole-sequence attention (megalite/attention/local.py) on its
    heads with their slice of the sinks (under `run`: selective recompute's checkpoint, as `attend` is); hybrid
    both."""
    docs, variant = masking.docs, masking.variant
    attend, backend, run = local.attend, local.backend, local.run
    if options.mode == "ring":
        return ring_attention(q, k, v, state, backend=backend, docs=docs, variant=variant)
    if options.mode == "allgather":
        return allgather_attention(q, k, v, state, backend=backend, docs=docs, variant=variant)
    if options.mode == "a2a":
        if not variant.is_plain:
            cp = state.size(GROUP)
            heads = variant_heads(variant, head_group(state, cp), cp)
            full = None if docs is None else docs.full
            return a2a_attention(q, k, v, state,
                                 lambda q_, k_, v_: run(variant_attention, q_, k_, v_, heads, full, backend))
        if docs is not None:
            keep = document_causal_mask(docs.full, docs.full)
            return a2a_attention(q, k, v, state, lambda q_, k_, v_: attend(q_, k_, v_, keep))
        return a2a_attention(q, k, v, state, attend)
    if options.mode == "hybrid":
        return hybrid_attention(q, k, v, state, options.a2a_degree, backend, docs, variant)
    raise ValueError(f"cp mode {options.mode!r}: expected one of ring, allgather, a2a, hybrid")
