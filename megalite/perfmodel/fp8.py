"""What `fp8.recipe` changes in the estimate: which GEMMs run in FP8 under the filter, their share of the
matmul FLOPs, the amax all-reduce traffic, the transient FP8 weight copies, and the FP8 peak.

The filter and the amax reductions are megalite/layers/fp8.py's own (`fp8_filter`, `amax_reductions`), so
the prediction counts exactly what a run sends (tests/test_fp8_layers.py checks the counter against the
same function). docs/fp8.md explains the recipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megalite.layers.fp8 import Splits, amax_reductions, fp8_filter
from megalite.perfmodel.inputs import Layout, ModelDims


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


def layer_gemms(dims: ModelDims, min_dim: int) -> list[Gemm]:
    """The four linears of one block (megalite/model/block.py's names) and the filter's choice for each."""
    h, q, kv, f = dims.hidden_size, dims.num_heads * dims.hd, dims.kv_heads * dims.hd, dims.ffn
    up = (f, f) if dims.arch == "llama" else (f,)
    shapes = [("attn.qkv", h, (q, kv, kv), "column"), ("attn.out", q, (h,), "row"),
              ("mlp.up", h, up, "column"), ("mlp.down", f, (h,), "row")]
    return [Gemm(n, i, o, k, fp8_filter(n, i, list(o), min_dim)) for n, i, o, k in shapes]


@dataclass
class Fp8Estimate:
    """The FP8 figures of one layout (per device; bytes per step)."""

    recipe: str
    min_dim: int
    gemms: list[dict]
    fp8_flops_fraction: float     # of the hardware FLOPs: the FP8 GEMMs' 6 x weights per token
    amax_bytes: dict[str, float]  # ring bytes per step of the amax all-reduces, by counter key
    weight_copy_bytes: float      # the largest transient e4m3 copy of one weight shard (1 byte per element)
    fp8_peak_flops: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def fp8_estimate(dims: ModelDims, layout: Layout, recipe: str, min_dim: int, hardware_per_token: float,
                 fp8_peak: float | None) -> Fp8Estimate:
    gemms = layer_gemms(dims, min_dim)
    fp8_weights = dims.num_layers * sum(g.weights for g in gemms if g.fp8)
    fraction = 6.0 * fp8_weights / hardware_per_token
    amax = amax_bytes([(g, dims.num_layers // layout.pp) for g in gemms if g.fp8], layout, recipe, dims.seq_len)
    copy = max((g.weights // layout.tp for g in gemms if g.fp8), default=0)
    return Fp8Estimate(recipe, min_dim, [asdict(g) for g in gemms], fraction, amax, float(copy), fp8_peak)


def amax_bytes(gemms: list[tuple[Gemm, float]], layout: Layout, recipe: str, seq_len: int) -> dict[str, float]:
    """Ring bytes per step, by counter key, of the amax all-reduces of FP8 linears (each with the number of
    its layers on a stage): `amax_reductions` per call, for every micro-batch."""
    tokens = layout.micro_batch_size * layout.local_seq_len(seq_len)  # at a GEMM: SP's pieces are gathered
    sizes = {"tp": layout.tp, "cp": layout.cp}
    amax: dict[str, float] = {}
    tp_g: tuple = ("tp",) if layout.tp > 1 else ()
    for g, layers in gemms:
        out_local, in_local = sum(g.out_parts), g.in_features
        if g.kind == "column":
            out_local //= layout.tp
        else:
            in_local //= layout.tp
        splits = Splits(("cp",) if layout.cp > 1 else (), tp_g if g.kind == "row" else (), tp_g if g.kind == "column" else ())
        for groups, n in amax_reductions(recipe, splits, tokens, in_local, out_local):  # type: ignore[arg-type]
            for grp in groups:
                size = sizes[grp]
                amax[grp] = amax.get(grp, 0.0) + 2.0 * (size - 1) / size * 4.0 * n * layers * layout.num_microbatches
    return amax
