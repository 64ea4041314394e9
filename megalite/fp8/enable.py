"""Which modules run in FP8 (`fp8.recipe`): the settings, and `enable_fp8`, which gives every filtered parallel linear
its `Fp8Gemm` (megalite/fp8/linear.py) and every filtered module of experts its `Fp8ExpertGemm`
(megalite/fp8/experts.py). The filter is megalite/fp8/costs.py's `fp8_filter`, on logical shapes, so every layout
makes the same choice and the estimator predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch.nn as nn

from megalite.fp8 import scaled_mm as smm
from megalite.fp8.costs import BLOCK, FP8_CHOICES, RECIPES, Groups, Recipe, Splits, fp8_filter
from megalite.fp8.experts import Fp8ExpertGemm, Fp8Experts
from megalite.fp8.linear import Fp8Gemm
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.layers.linear_fn import TakesGemms
from megalite.parallel.param_spec import DeclaresParamSpecs
from megalite.parallel.state import ParallelState


@dataclass(frozen=True)
class Fp8Settings:
    """`fp8.recipe` and its filter: a linear runs in FP8 when it is not the output layer and
    min(in_features, every output part) >= min_dim, on the logical (unsharded) shape so that every
    layout makes the same choice."""

    recipe: Recipe
    min_dim: int


def fp8_settings(recipe: str, min_dim: int) -> Fp8Settings | None:
    """`fp8.recipe` / `fp8.min_dim` as settings (None for "none"); validation has checked the name."""
    if recipe == "none":
        return None
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {FP8_CHOICES}")
    return Fp8Settings(cast(Recipe, recipe), min_dim)


def gemm_note(recipe: str) -> str | None:
    """The training log's line on how a recipe's GEMMs run (None for the recipes torch._scaled_mm runs as asked)."""
    if recipe not in BLOCK:
        return None
    return (f"fp8 {recipe}: block-scaled GEMMs emulated (quantise, dequantise, fp32 matmul; megalite/fp8/blocks.py) on "
            "every device: torch._scaled_mm's block-scaled modes are not used, so expect no FP8 speed-up")


def linear_shapes(module: nn.Module) -> tuple[str, int, list[int]] | None:
    """('column' | 'row', logical in_features, logical output parts) of a parallel linear, else None."""
    if isinstance(module, ColumnParallelLinear):
        return "column", module.weight.shape[1], list(module.out_parts)
    if isinstance(module, RowParallelLinear):
        return "row", module.weight.shape[1] * module.state.tp, [module.weight.shape[0]]
    return None


def stacked_dims(module: nn.Module) -> list[int]:
    """Every logical size of the matrices `module`'s own parameters stack (`ParamSpec.stack`: the MoE experts'
    hidden and ffn sizes); empty for a module holding no stack."""
    if not isinstance(module, DeclaresParamSpecs):
        return []
    specs = module.param_specs()
    stacks = [(specs[n].stack, p) for n, p in module.named_parameters(recurse=False) if n in specs]
    return [d for stack, p in stacks if stack is not None for d in stack.dims(p.shape[-1])]


def enable_fp8(chunks: list[nn.Module], settings: Fp8Settings | None, state: ParallelState) -> list[str]:
    """Give every filtered parallel linear of `chunks` its `Fp8Gemm`, and every filtered module of experts its
    `Fp8ExpertGemm` (megalite/fp8/experts.py; None settings: leave all in the run dtype); returns the
    names of the FP8 modules."""
    if settings is None:
        return []
    smm.check_available()
    tokens: Groups = ("cp",) if state.cp > 1 else ()
    tp: Groups = ("tp",) if state.tp > 1 else ()
    chosen = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            dims = stacked_dims(module)
            if dims and isinstance(module, Fp8Experts):  # its GEMMs share the rule: min(hidden, ffn)
                if fp8_filter(name, dims[0], dims[1:], settings.min_dim):
                    module.fp8 = Fp8ExpertGemm(settings.recipe)
                    chosen.append(name)
                continue
            shapes = linear_shapes(module)
            if (shapes is None or not isinstance(module, TakesGemms)
                    or not fp8_filter(name, shapes[1], shapes[2], settings.min_dim)):
                continue
            kind = shapes[0]
            splits = Splits(tokens, tp if kind == "row" else (), tp if kind == "column" else ())
            module.set_gemms(Fp8Gemm(settings.recipe, splits, state))
            chosen.append(name)
    return chosen
