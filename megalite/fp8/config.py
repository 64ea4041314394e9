"""The `[fp8]` config section (docs/fp8.md) and its checks. The section is torch-free, so `megalite.config`
reads it cheaply; `problems` asks torch (in `megalite.fp8.checks`, imported there) whether this build and device
can run FP8, and `layout_problems` whether a block recipe's blocks stay whole on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.fp8.costs import FP8_CHOICES, Gemm, block_gemms, shared_expert_gemms
from megalite.section import doc_field as _f

RECIPES = FP8_CHOICES


@dataclass
class FP8Config:
    recipe: str = _f("none", "FP8 matmuls in the block linears and expert GEMMs: none | tensorwise | rowwise "
                             "(current scaling) | blockwise (DeepSeek-V3: 1x128 / 128x128 blocks) | mxfp8 (1x32, "
                             "e8m0 scales) (docs/fp8.md)")
    min_dim: int = _f(128, "FP8 filter: a linear stays in the run dtype when its smallest logical dimension "
                           "is below this (the output layer always does)")


def section_problems(fp8: FP8Config) -> list[str]:
    """The section's own values, torch-free: what the estimator (tools/estimate.py) checks too, on a machine
    that need not run FP8 itself."""
    if fp8.recipe not in RECIPES:
        return [f"fp8.recipe: {fp8.recipe!r} is not one of {', '.join(RECIPES)}"]
    if fp8.recipe != "none" and fp8.min_dim < 1:
        return [f"fp8.min_dim must be >= 1, got {fp8.min_dim}"]
    return []


def problems(fp8: FP8Config, dtype: str, device_type: str) -> list[str]:
    """`[fp8]` against the torch, the device and the run dtype (`train.dtype`) it would run with, one line each."""
    out = section_problems(fp8)
    if out or fp8.recipe == "none":
        return out
    from megalite.fp8.checks import fp8_problems  # here, not at the top: the section stays torch-free

    return fp8_problems(fp8.recipe, fp8.min_dim, dtype, device_type)


def layout_problems(fp8: FP8Config, m: Any, tp: int, cp: int, attention: list[Gemm] | None = None) -> list[str]:
    """A block recipe's blocks against the layout, for model `m` (a `ModelSpec`: `[model]` with its `[moe]`):
    the attention's GEMMs (`attention`, where the model's are not plain attention's: MLA's), a dense layer's MLP and the shared experts' (the routed experts are whole per rank)."""
    if fp8.recipe not in RECIPES or fp8.recipe == "none":
        return []
    from megalite.fp8.checks import block_layout_problems

    hd = m.head_dim or m.hidden_size // max(m.num_heads, 1)
    gated, q, kv = m.arch == "llama", m.num_heads * hd, (m.num_kv_heads or m.num_heads) * hd
    dense = block_gemms(m.hidden_size, q, kv, m.ffn_hidden_size, gated, fp8.min_dim)
    gemms = attention if attention is not None else [g for g in dense if g.name.startswith("attn.")]
    s = m.moe.resolved(m.ffn_hidden_size)
    if s is None or len(m.moe.layers(m.num_layers)) < m.num_layers:  # a dense layer's MLP
        gemms += [g for g in dense if g.name.startswith("mlp.")]
    if s is not None and s.shared_experts:
        gemms += shared_expert_gemms(m.hidden_size, s.shared_experts * s.shared_ffn_hidden_size, gated, fp8.min_dim)
    return block_layout_problems(fp8.recipe, gemms, tp, cp, m.seq_len)
