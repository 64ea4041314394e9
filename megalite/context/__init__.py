"""Context parallelism: one sequence split across the ranks of a cp group (docs/parallelism.md).

    zigzag     the load-balanced split (rank r holds chunks r and 2cp-1-r), positions, and its inverse
    group      the cp ring's rank order, and the typed view of the ParallelState the attention functions use
    documents  document masking: each token's document and position, the one document-mask rule
    blockwise  the block math's names (block attention with its log-sum-exp, its backward, the merge, the sinks),
               defined one layer down in megalite/attention/blocks.py
    ring       ring attention (K/V passed around, overlapped with compute; dK/dV passed back)
    allgather  the all-gather-K/V form (Llama 3)
    a2a        the all-to-all form (DeepSpeed-Ulysses): sequence-sharded <-> head-sharded
    hybrid     all-to-all inside groups of cp ranks, the ring across them (USP, Megatron's a2a+p2p)
    options    the cp mode the model is built with (`parallel.cp_mode`); attend: the dispatch on it
    costs      what each form costs (bytes, the ring's FLOPs per step), in closed form; torch-free, which is
               why this package re-exports nothing: `import megalite.context.costs` loads no torch

Import from the module that defines a name (`from megalite.context.options import ContextOptions`).
"""
