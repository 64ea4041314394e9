"""Hybrid context parallelism: all-to-all inside groups of `a2a` cp ranks, the ring across them (Megatron-LM's
`a2a+p2p` hierarchical cp; Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach").

cp = a2a x R. The a2a group of cp rank r is the `a2a` consecutive cp ranks around it (the rank order tp, cp, dp,
pp puts consecutive cp ranks next to each other, inside a node: the all-to-all takes the fast links), its ring
the R cp ranks with its cp_rank mod a2a (`ContextGroup.ring_of`, across nodes: the ring hides its transfers
behind attention compute). Per attention call:

1. all-to-all inside the group (`a2a.a2a_attention` with degree a2a): each rank gets hq/a2a query and
   hk/a2a kv heads of the group's tokens;
2. the group's tokens are exactly ring rank i's zigzag split of an R-way cut (i = cp_rank // a2a): group i
   holds chunks i·a2a .. i·a2a + a2a - 1 of the 2·cp chunks, one contiguous chunk i of the 2R-way cut, and
   their mirror images, chunk 2R-1-i. So, permuted into position order, they are what `ring_attention` over
   the R ranks expects, and the ring runs unchanged on them (document masks included);
3. the output goes back by the inverse all-to-all.

Bytes per rank per call (t = b (S/cp) d e, as in a2a.py; the ring's kv = 2 b (S/R) (hk/a2a) d elements):

    forward   (a2a-1)/a2a t (2 hq + 2 hk)  +  (R-1) kv e
    backward  (a2a-1)/a2a t (2 hq + 2 hk)  +  (R-1) kv (e + 4)

The heads (after tp) must split into a2a groups (validation explains); the ring has no such limit, which is
why hybrid reaches cp beyond the head count at a fraction of the ring's bytes.
"""

from __future__ import annotations

import torch

from megalite.attention.blocks import Backend
from megalite.attention.variant import PLAIN, AttentionVariant, variant_heads
from megalite.context.documents import DocumentIds
from megalite.context.group import GROUP, ContextGroup
from megalite.context.ring import ring_attention
from megalite.context.a2a import a2a_attention, head_group
from megalite.context.zigzag import zigzag_split
from megalite.errors import ConfigError
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def check_hybrid(cp: int, a2a: int) -> None:
    """A ConfigError unless the a2a degree divides cp."""
    if a2a < 1 or cp % a2a:
        raise ConfigError(f"cp_mode=hybrid: parallel.cp_a2a = {a2a} must be >= 1 and divide parallel.cp = {cp} "
                          "(cp = a2a groups x ring length)")


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, a2a: int, backend: Backend = "torch",
                     docs: DocumentIds | None = None, variant: AttentionVariant = PLAIN) -> Tensor:
    """The contract of `ring_attention` (this rank's zigzag-split q/k/v of a cp-way split in, its rows of causal
    attention out), computed by an all-to-all over `a2a` cp ranks and a ring over cp / a2a of them. The ring
    runs the variant on this rank's head group (its sinks sliced with the heads, `variant_heads`); its window
    is in global positions, which the ring's zigzag split of the group's tokens keeps (module doc, point 2)."""
    cp = state.size(GROUP)
    check_hybrid(cp, a2a)
    ring = ContextGroup.ring_of(state, a2a)
    ring_docs = None if docs is None else DocumentIds(zigzag_split(docs.full, ring.cp, ring.cp_rank), docs.full)

    def across(q_: Tensor, k_: Tensor, v_: Tensor) -> Tensor:  # a ring of one rank (a2a = cp): its diagonal block
        return ring_attention(q_, k_, v_, state, backend=backend, docs=ring_docs, variant=heads, ring=ring)

    heads = variant_heads(variant, head_group(state, a2a), a2a)

    return a2a_attention(q, k, v, state, across, degree=a2a)
