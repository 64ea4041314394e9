"""Triton fused kernels, each with an autograd.Function and a plain-torch reference.

| kernel                         | file                | fuses / saves                                            |
|--------------------------------|---------------------|----------------------------------------------------------|
| rms_norm, layer_norm (+ add_)  | norms.py            | residual add + norm; saves rstd (+ mean) per row         |
| apply_rope                     | rope.py             | q and k in one launch; saves only cos/sin                |
| swiglu                         | swiglu.py           | silu(gate) * up; backward recomputes silu                |
| gelu_tanh                      | gelu.py             | tanh-GeLU; backward recomputes tanh                      |
| cross_entropy (+ vocab-parallel)| cross_entropy.py   | online softmax, grad written into the logits in place    |
| flash_attention                | flash_attention.py  | causal GQA attention; saves O and logsumexp (FA-2)       |
|   (its segment ids / variants) | flash_attention_variant.py | window, soft-cap, sinks, documents: helpers, checks |
| flash_attention_block (+ bwd)  | flash_attention_block.py | one key block of a longer softmax: (O, LSE) out;     |
|                                |                     | backward from the merged LSE (context parallelism)       |
| ChunkGatedDelta                | gated_delta.py      | the gated delta rule by chunks, state in registers;      |
|                                |                     | saves the state entering each chunk for the backward     |

Importing this package never imports Triton: it is imported when the first kernel launches (see
`_triton.py`), so the `*_reference` functions work everywhere and TRITON_INTERPRET=1 may be set
after `import megalite.kernels`. Use `available()` to decide whether the Triton versions can run here.
"""

from __future__ import annotations

import torch

from ._triton import have_triton, interpreting
from .cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_reference,
)
from .flash_attention import flash_attention
from .flash_attention_reference import flash_attention_reference
from .flash_attention_block import (
    flash_attention_block,
    flash_attention_block_backward,
    flash_attention_block_reference,
)
from .gated_delta import ChunkGatedDelta, chunk_gated_delta_fwd
from .gelu import gelu_tanh, gelu_tanh_reference
from .norms import (
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from .rope import apply_rope, apply_rope_reference
from .swiglu import swiglu, swiglu_reference


def available() -> bool:
    """True when the Triton kernels can run: triton is installed, and there is a CUDA device or
    TRITON_INTERPRET=1 (the CPU interpreter; set it before the first kernel launches)."""
    return have_triton() and (torch.cuda.is_available() or interpreting())


__all__ = [
    "available",
    "rms_norm", "rms_norm_reference", "layer_norm", "layer_norm_reference",
    "add_rms_norm", "add_rms_norm_reference", "add_layer_norm", "add_layer_norm_reference",
    "apply_rope", "apply_rope_reference",
    "swiglu", "swiglu_reference", "gelu_tanh", "gelu_tanh_reference",
    "cross_entropy", "cross_entropy_reference",
    "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_reference",
    "flash_attention", "flash_attention_reference",
    "flash_attention_block", "flash_attention_block_backward", "flash_attention_block_reference",
    "ChunkGatedDelta", "chunk_gated_delta_fwd",
]
