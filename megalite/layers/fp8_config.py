"""The `[fp8]` config section (docs/fp8.md) and its checks. The section is torch-free, so `megalite.config`
reads it cheaply; `problems` asks torch (imported there) whether this build and device can run FP8."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.section import doc_field as _f

RECIPES = ("none", "tensorwise", "rowwise")


@dataclass
class FP8Config:
    recipe: str = _f("none", "FP8 matmuls in the block linears and expert GEMMs, current scaling: "
                             "none | tensorwise | rowwise (docs/fp8.md)")
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
    if fp8.recipe not in RECIPES or fp8.recipe == "none":
        return out
    import torch  # here, not at the top: the section stays torch-free

    from megalite.errors import ConfigError
    from megalite.layers import scaled_mm

    try:
        scaled_mm.check_available()
    except ConfigError as e:
        out.append(str(e))
    if dtype == "fp16":
        out.append(f"fp8.recipe={fp8.recipe} with train.dtype=fp16 is not supported (fp16 loss scaling would scale "
                   "the gradients FP8 re-scales anyway): use train.dtype=bf16 (or fp32)")
    if device_type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < scaled_mm.MIN_CUDA_CAPABILITY:
            out.append(f"fp8.recipe={fp8.recipe} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
                       f"newer) but {torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}: set fp8.recipe=none")
    return out
