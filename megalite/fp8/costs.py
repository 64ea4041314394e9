"""FP8's torch-free facts and formulas: the recipes, the filter, which amaxes are all-reduced, the scale tensors'
bytes, the FP8 share of a module's FLOPs. megalite/perfmodel imports them (never restates them); the FP8 modules
(megalite/fp8/linear.py, experts.py) use the same functions, so the estimate counts what a run does.

Per linear call y = x W^T, x [T, in], W [out, in], g [T, out] (forward and both backward GEMMs), the scale
elements each recipe makes (`scale_elements`; c(n, b) = ceil(n / b)):

    recipe      fprop (x, W)                   dgrad (g, W)                   wgrad (g^T, x over tokens)     bytes
    tensorwise  1 + 1                          1 + 1                          reuses fprop's and dgrad's      4
    rowwise     T + out                        T + in                         out + in                        4
    blockwise   T c(in,128) + c(out,128)c(in,128)  T c(out,128) + c(out,128)c(in,128)  out c(T,128) + in c(T,128)  4
    mxfp8       T c(in,32) + out c(in,32)      T c(out,32) + in c(out,32)     out c(T,32) + in c(T,32)        1 (e8m0)

The block recipes (megalite/fp8/blocks.py) reduce no amax across ranks (`amax_reductions` is empty for them): a
block never spans two ranks in a layout `megalite.fp8.checks.block_layout_problems` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from megalite.parallel.state import GroupKind

Recipe = Literal["tensorwise", "rowwise", "blockwise", "mxfp8"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise", "mxfp8")
FP8_CHOICES: tuple[str, ...] = ("none",) + RECIPES
# The block recipes: a block's length along a GEMM's contraction dim, its height along a weight's other dim
# (DeepSeek-V3's 128x128 weight blocks; MX blocks are 1 x 32 for every operand), and a scale's bytes.
BLOCK: dict[str, int] = {"blockwise": 128, "mxfp8": 32}
WEIGHT_BLOCK: dict[str, int] = {"blockwise": 128, "mxfp8": 1}
SCALE_BYTES: dict[str, int] = {"tensorwise": 4, "rowwise": 4, "blockwise": 4, "mxfp8": 1}

Groups = tuple["GroupKind", ...]


def is_block_recipe(recipe: str) -> bool:
    return recipe in BLOCK


@dataclass(frozen=True)
class Splits:
    """The groups splitting each dimension of a linear's 2-D operands at its GEMMs."""

    tokens: Groups  # T (cp)
    inner: Groups   # in (tp for a row-parallel linear)
    outer: Groups   # out (tp for a column-parallel linear)


def fp8_filter(name: str, in_features: int, out_parts: list[int], min_dim: int) -> bool:
    """Whether the linear `name` (a module path) with these logical sizes runs in FP8: not the output layer, and
    min(in_features, every output part) >= min_dim, on the unsharded shape so every layout chooses alike."""
    if name == "head" or name.endswith(".head"):  # the output layer stays in the run dtype (torchao, TE)
        return False
    return min([in_features, *out_parts]) >= min_dim


def amax_reductions(recipe: str, splits: Splits, tokens: int, in_local: int, out_local: int) -> list[tuple[Groups, int]]:
    """(groups, fp32 elements) of every amax all-reduce one linear call makes, forward and backward (input
    and weight gradients both needed): what `Fp8Gemm.quantize` sends, for the estimator and the tests."""
    s = splits
    if is_block_recipe(recipe):  # a block lies on one rank (module doc)
        return []
    if recipe == "tensorwise":  # x, W (fprop); g, W again (dgrad); wgrad reuses g's and x's
        return [(s.tokens + s.inner, 1), (s.outer + s.inner, 1), (s.tokens + s.outer, 1), (s.outer + s.inner, 1)]
    return [(s.inner, tokens), (s.inner, out_local),     # fprop: x per token, W per row
            (s.outer, tokens), (s.outer, in_local),      # dgrad: g per token, W per column
            (s.tokens, out_local), (s.tokens, in_local)]  # wgrad: g per output row, x per input column


def _c(n: int, b: int) -> int:
    return -(-n // b)


def scale_elements(recipe: str, tokens: int, in_local: int, out_local: int) -> int:
    """The scale elements one linear call makes, forward and backward (module doc's table)."""
    t, i, o = tokens, in_local, out_local
    if recipe == "tensorwise":
        return 4
    if recipe == "rowwise":
        return 2 * (t + i + o)  # (T + out) + (T + in) + (out + in)
    b, wb = BLOCK[recipe], WEIGHT_BLOCK[recipe]
    return (t * _c(i, b) + _c(o, wb) * _c(i, b)      # fprop: x per token, W per block along in
            + t * _c(o, b) + _c(i, wb) * _c(o, b)    # dgrad: g per token, W per block along out
            + (o + i) * _c(t, b))                    # wgrad: g^T and x per block of tokens


def scale_bytes(recipe: str, tokens: int, in_local: int, out_local: int) -> int:
    """`scale_elements` in bytes (fp32 scales; MX's e8m0 exponents one byte each)."""
    return scale_elements(recipe, tokens, in_local, out_local) * SCALE_BYTES[recipe]


@dataclass(frozen=True)
class Gemm:
    """One linear of a transformer layer: logical sizes, whether it runs in FP8, its parallel kind."""

    name: str
    in_features: int
    out_parts: tuple[int, ...]
    kind: str  # "column" | "row"
    fp8: bool

    @property
    def weights(self) -> int:
        return self.in_features * sum(self.out_parts)


def _gemms(shapes: list[tuple[str, int, tuple[int, ...], str]], min_dim: int) -> list[Gemm]:
    return [Gemm(n, i, o, k, fp8_filter(n, i, list(o), min_dim)) for n, i, o, k in shapes]


def block_gemms(hidden: int, q: int, kv: int, ffn: int, gated: bool, min_dim: int) -> list[Gemm]:
    """The four linears of a dense block (megalite/model/block.py's names: q, k, v widths `q`, `kv`, `kv`; a
    gated MLP's up is gate and up) and the filter's choice for each."""
    up = (ffn, ffn) if gated else (ffn,)
    return _gemms([("attn.qkv", hidden, (q, kv, kv), "column"), ("attn.out", q, (hidden,), "row"),
                   ("mlp.up", hidden, up, "column"), ("mlp.down", ffn, (hidden,), "row")], min_dim)


def shared_expert_gemms(hidden: int, width: int, gated: bool, min_dim: int) -> list[Gemm]:
    """A MoE layer's shared experts: one dense MLP of `width` (shared experts x their ffn), filtered like any linear."""
    up = (width, width) if gated else (width,)
    return _gemms([("mlp.shared.up", hidden, up, "column"), ("mlp.shared.down", width, (hidden,), "row")], min_dim)


def amax_bytes(gemms: list[tuple[Gemm, float]], recipe: str, tokens: int, tp: int, cp: int,
               microbatches: int) -> dict[str, float]:
    """Ring bytes per step, by counter key, of the amax all-reduces of FP8 linears (each with the number of its
    layers on a stage): `amax_reductions` per call, for every micro-batch; `tokens` at a GEMM (SP gathered)."""
    sizes = {"tp": tp, "cp": cp}
    amax: dict[str, float] = {}
    tp_g: Groups = ("tp",) if tp > 1 else ()
    for g, layers in gemms:
        in_local, out_local = local_sizes(g, tp)
        splits = Splits(("cp",) if cp > 1 else (), tp_g if g.kind == "row" else (), tp_g if g.kind == "column" else ())
        for groups, n in amax_reductions(recipe, splits, tokens, in_local, out_local):
            for grp in groups:
                size = sizes[grp]
                amax[grp] = amax.get(grp, 0.0) + 2.0 * (size - 1) / size * 4.0 * n * layers * microbatches
    return amax


def local_sizes(g: Gemm, tp: int) -> tuple[int, int]:
    """(in, out) of one tp rank's shard of linear `g`."""
    out_local, in_local = sum(g.out_parts), g.in_features
    return (in_local, out_local // tp) if g.kind == "column" else (in_local // tp, out_local)


@dataclass(frozen=True)
class ModuleFlops:
    """Hardware FLOPs per token of one module without recompute, the FP8 ones among them, and the forward's
    share (which full recompute runs again, in FP8 where the module is)."""

    flops: float
    fp8_flops: float
    forward_flops: float


def linear_flops(weights: int, fp8: bool) -> ModuleFlops:
    """A linear of `weights` per token: fprop, dgrad and wgrad, 2 W each, all three in FP8 when it is."""
    return ModuleFlops(6.0 * weights, 6.0 * weights if fp8 else 0.0, 2.0 * weights)


def expert_flops(one_expert: int, top_k: int, fp8: bool) -> ModuleFlops:
    """A token's `top_k` routed experts of `one_expert` weights each: fprop and dgrad in FP8 when the module is,
    the weight gradient in the run dtype (it contracts over an expert's tokens, which no layout-free FP8 scale
    covers: megalite/fp8/experts.py)."""
    w = float(top_k * one_expert)
    return ModuleFlops(6.0 * w, 4.0 * w if fp8 else 0.0, 2.0 * w)
