"""The attention block's one call into the attention math: plain or variant, one rank or context-parallel.

q, k, v come RoPE'd and split by heads; the result is this rank's attention rows ([b, s, heads, head_dim]).
"""

from __future__ import annotations

import torch

from megalite.attention.local import variant_attention
from megalite.context.attend import Local, Masking, Runner, context_attention
from megalite.context.documents import document_causal_mask
from megalite.context.options import ContextOptions
from megalite.model.ops import Ops, masked_attention
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, masking: Masking, state: ParallelState, context: ContextOptions,
           ops: Ops, run: Runner) -> Tensor:
    def core(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
        """Causal attention over whole sequences in position order (the model's kernel), or under `keep`."""
        fn, args = (ops.attention, (q, k, v)) if keep is None else (masked_attention, (q, k, v, keep))
        return run(fn, *args)

    docs, variant = masking.docs, masking.variant
    if state.cp > 1:
        # Context parallelism (parallel.cp_mode): ring / allgather compute block pairs (torch block math or
        # the Triton flash kernel) whose backward keeps only q, k, v, the output and the log-sum-exp and
        # recomputes the scores block by block, which is what selective recompute saves, so they are not
        # checkpointed again (no second forward, no extra cp bytes); a2a runs `core` (or the variant's attention
        # under `run`) on heads/cp. Document masking rides in the blocks' position masks (the flash blocks take
        # the documents as segment ids).
        local = Local(core, ops.block_backend, run)
        return context_attention(q, k, v, state, context, local, masking)
    if not variant.is_plain:
        return run(variant_attention, q, k, v, variant, None if docs is None else docs.local, ops.block_backend)
    if docs is not None:
        if ops.document_attention is not None:
            return run(ops.document_attention, q, k, v, docs.local)
        return core(q, k, v, document_causal_mask(docs.local, docs.local))
    return core(q, k, v)
