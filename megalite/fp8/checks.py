"""FP8's config problems, one line each (docs/fp8.md, "Refused configurations"); config validation calls them with
the fields they need (megalite/fp8/config.py) and reports them with every other problem. The block-layout rule
covers every tp-split FP8 linear a layer has: plain attention's, MLA's (`megalite.mla.costs.mla_gemms`), the MLPs'
and shared experts'."""

from __future__ import annotations

import torch

from megalite.errors import ConfigError
from megalite.fp8 import scaled_mm
from megalite.fp8.costs import BLOCK, WEIGHT_BLOCK, Gemm


def fp8_problems(recipe: str, min_dim: int, dtype: str, device_type: str) -> list[str]:
    """`fp8.recipe` against the torch, the device and the dtype it would run with."""
    if recipe == "none":
        return []
    out: list[str] = []  # min_dim: the section's own check (megalite/fp8/config.py)
    try:
        scaled_mm.check_available()
    except ConfigError as e:
        out.append(str(e))
    if dtype == "fp16":
        out.append(f"fp8.recipe={recipe} with train.dtype=fp16 is not supported (fp16 loss scaling would scale the "
                   "gradients FP8 re-scales anyway): use train.dtype=bf16 (or fp32)")
    if device_type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < scaled_mm.MIN_CUDA_CAPABILITY:
            out.append(f"fp8.recipe={recipe} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
                       f"newer) but {torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}: set fp8.recipe=none")
    return out


def block_layout_problems(recipe: str, gemms: list[Gemm], tp: int, cp: int, seq_len: int) -> list[str]:
    """The block recipes reduce no amax across ranks, which holds when no block spans two ranks
    (megalite/fp8/blocks.py): every tp-split dimension of an FP8 linear (each output part of a column-parallel
    one, the input of a row-parallel one) in whole blocks per rank, and under cp each sequence chunk a rank holds
    (seq_len / (2 cp), the zigzag split's) in whole token blocks (the weight gradient's blocks run over tokens)."""
    if recipe not in BLOCK:
        return []
    out: list[str] = []
    block = BLOCK[recipe]
    if tp > 1:
        # A weight's blocks along its other dim (128 for blockwise) must also stay whole on a rank.
        need = max(block, WEIGHT_BLOCK[recipe])
        for g in gemms:
            dims = list(g.out_parts) if g.kind == "column" else [g.in_features]
            bad = [d for d in dims if d % (tp * need)]
            if g.fp8 and bad:
                out.append(f"fp8.recipe={recipe} at tp={tp}: {g.name} splits a dimension of {bad[0]} into {bad[0] // tp}-"
                           f"wide shards, not whole {need}-blocks (a block would span two tp ranks): use a tp that "
                           f"leaves {need} | dim/tp, fp8.min_dim > {min([g.in_features, *g.out_parts])} to keep "
                           "it in the run dtype, or fp8.recipe=rowwise")
                break
    if cp > 1 and (seq_len // (2 * cp)) % block:
        out.append(f"fp8.recipe={recipe} at cp={cp}: each rank's sequence chunks are seq_len/(2 cp) = "
                   f"{seq_len // (2 * cp)} tokens, not whole {block}-token blocks (a weight-gradient block would span "
                   f"two cp ranks): use a seq_len multiple of {2 * cp * block}, or fp8.recipe=rowwise")
    return out
