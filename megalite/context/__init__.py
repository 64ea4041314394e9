"""Context parallelism: one sequence split across the ranks of a cp group (docs/parallelism.md).

    zigzag     the load-balanced split (rank r holds chunks r and 2cp-1-r), positions, and its inverse
    group      the cp ring's rank order, and the typed view of the ParallelState the attention functions use
    blockwise  block attention returning its log-sum-exp, its backward, the online-softmax merge
    ring       ring attention (K/V passed around, overlapped with compute; dK/dV passed back)
    allgather  the all-gather-K/V form (Llama 3)
    a2a        the all-to-all form (DeepSpeed-Ulysses): sequence-sharded <-> head-sharded
    hybrid     all-to-all inside groups of cp ranks, the ring across them (USP, Megatron's a2a+p2p)
    options    the cp mode the model is built with (`parallel.cp_mode`); attend: the dispatch on it
    costs      the bytes each form moves, in closed form
"""

from megalite.context.allgather import allgather_attention
from megalite.context.attend import context_attention
from megalite.context.costs import (CpBytes, a2a_attention_bytes, allgather_attention_bytes, cp_attention_bytes,
                                    hybrid_attention_bytes, ring_attention_bytes)
from megalite.context.hybrid import check_hybrid, hybrid_attention
from megalite.context.group import ContextGroup
from megalite.context.options import CP_MODES, ContextOptions, CpMode
from megalite.context.ring import ring_attention
from megalite.context.a2a import a2a_attention, check_a2a_heads
from megalite.context.zigzag import check_zigzag, zigzag_merge, zigzag_positions, zigzag_split

__all__ = ["CP_MODES", "ContextGroup", "ContextOptions", "CpBytes", "CpMode", "a2a_attention", "a2a_attention_bytes",
           "allgather_attention", "allgather_attention_bytes", "check_a2a_heads", "check_hybrid", "check_zigzag",
           "hybrid_attention", "hybrid_attention_bytes",
           "context_attention", "cp_attention_bytes", "ring_attention", "ring_attention_bytes",
           "zigzag_merge", "zigzag_positions", "zigzag_split"]
