"""Context parallelism: one sequence split across the ranks of a cp group (docs/parallelism.md).

    zigzag     the load-balanced split (rank r holds chunks r and 2cp-1-r), positions, and its inverse
    group      the cp ring's rank order, and the typed view of the ParallelState the attention functions use
    blockwise  block attention returning its log-sum-exp, its backward, the online-softmax merge
    ring       ring attention (K/V passed around, overlapped with compute; dK/dV passed back)
    allgather  the all-gather-K/V form (Llama 3)
    costs      the bytes each form moves, in closed form
"""

from megalite.context.allgather import allgather_attention
from megalite.context.costs import CpBytes, allgather_attention_bytes, ring_attention_bytes
from megalite.context.group import ContextGroup
from megalite.context.ring import ring_attention
from megalite.context.zigzag import check_zigzag, zigzag_merge, zigzag_positions, zigzag_split

__all__ = ["ContextGroup", "CpBytes", "allgather_attention", "allgather_attention_bytes", "check_zigzag",
           "ring_attention", "ring_attention_bytes",
           "zigzag_merge", "zigzag_positions", "zigzag_split"]
