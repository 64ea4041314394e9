"""What `fp8.recipe` changes in the estimate: which GEMMs run in FP8 under the filter, their share of the
matmul FLOPs, the amax all-reduce traffic, the scale tensors, the transient FP8 weight copies, and the FP8 peak.

The filter, the amax reductions, the scale sizes and the FLOP shares are megalite/fp8/costs.py's own (the
functions the FP8 modules use), so the prediction counts exactly what a run sends (tests/test_fp8_layers.py checks
the counter against the same function). docs/fp8.md explains the recipes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megalite.fp8.costs import Gemm, block_gemms, linear_flops, local_sizes, scale_bytes
from megalite.fp8.costs import amax_bytes as _amax_bytes
from megalite.perfmodel.inputs import Layout, ModelDims


def layer_gemms(dims: ModelDims, min_dim: int) -> list[Gemm]:
    """The four linears of one block and the filter's choice for each (`costs.block_gemms`)."""
    return block_gemms(dims.hidden_size, dims.num_heads * dims.hd, dims.kv_heads * dims.hd, dims.ffn,
                       dims.arch == "llama", min_dim)


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
    scale_bytes: float = 0.0      # one micro-batch's scale tensors of one layer's FP8 linears (costs.scale_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def fp8_estimate(dims: ModelDims, layout: Layout, recipe: str, min_dim: int, hardware_per_token: float,
                 fp8_peak: float | None) -> Fp8Estimate:
    gemms = layer_gemms(dims, min_dim)
    fp8_flops = dims.num_layers * sum(linear_flops(g.weights, g.fp8).fp8_flops for g in gemms)
    fraction = fp8_flops / hardware_per_token
    amax = amax_bytes([(g, dims.num_layers // layout.pp) for g in gemms if g.fp8], layout, recipe, dims.seq_len)
    copy = max((g.weights // layout.tp for g in gemms if g.fp8), default=0)
    tokens = layout.micro_batch_size * layout.local_seq_len(dims.seq_len)
    scales = sum(scale_bytes(recipe, tokens, *local_sizes(g, layout.tp)) for g in gemms if g.fp8)
    return Fp8Estimate(recipe, min_dim, [asdict(g) for g in gemms], fraction, amax, float(copy), fp8_peak,
                       float(scales))


def amax_bytes(gemms: list[tuple[Gemm, float]], layout: Layout, recipe: str, seq_len: int) -> dict[str, float]:
    """Ring bytes per step, by counter key, of the amax all-reduces of FP8 linears (each with the number of
    its layers on a stage): `costs.amax_bytes` at this layout's tokens per GEMM (SP's pieces gathered)."""
    tokens = layout.micro_batch_size * layout.local_seq_len(seq_len)
    return _amax_bytes(gemms, recipe, tokens, layout.tp, layout.cp, layout.num_microbatches)
