"""FP8 of a mixture-of-experts model in the estimate: every module `enable_fp8` puts in FP8, expert GEMMs included.

`megalite.perfmodel.fp8` counts a dense block's four linears. A MoE model's blocks differ by layer (`moe_layers`):
a dense layer has the attention's two linears and the MLP's two; a MoE layer has the attention's, a router (an fp32
matmul, never FP8), its routed experts (one module per layer, `layers.{i}.mlp.experts`, in FP8 when
min(hidden, expert ffn) >= fp8.min_dim, the rule of megalite/fp8/enable.py's `enable_fp8`) and optionally its
shared experts (a dense MLP `layers.{i}.mlp.shared`, of width shared x shared ffn, filtered like any linear).
`fp8_modules` names each module as `enable_fp8` returns it (tests/test_fp8_moe.py compares the two).

Per token, with full recompute's second forward counted where it runs (hardware FLOPs, not model FLOPs; the
formulas are megalite/fp8/costs.py's `linear_flops` and `expert_flops`):

    module           FP8 FLOPs per token                                  hardware FLOPs per token
    dense linear     6 x W (fprop, dgrad, wgrad) [+ 2 W full recompute]   the same (all its GEMMs are FP8)
    routed experts   k x 4 x W_e (fprop, dgrad)  [+ 2 k W_e]              k x 6 x W_e [+ 2 k W_e]

W: a linear's weights, W_e: one expert's (3 h F SwiGLU, 2 h F GeLU). An expert's weight gradient contracts over the
tokens the expert received, which no layout-free FP8 scale covers, so it runs in the run dtype
(megalite/fp8/experts.py): two of an expert's three GEMMs are FP8. The share is of the active model's
hardware FLOPs (`active_hardware_flops`: attention, each layer's MLP as the token computes it, the router, the head).

Amax traffic: the expert scales are per token and per expert weight, whole on their rank, so the experts reduce
nothing; the dense FP8 linears (attention, dense MLPs, shared experts) reduce as `megalite.perfmodel.fp8` counts.
FP8 weight copies: an FP8 expert module quantizes its E/ep local experts' stacked weight at once ([E/ep, out, in]
e4m3, one byte each; the forward's copy is freed before the backward makes its own), so the largest transient
copy is the larger of that and the largest dense FP8 linear's tp shard.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megalite.fp8.costs import Gemm, expert_flops, fp8_filter, linear_flops, shared_expert_gemms
from megalite.model.spec import ModelSpec
from megalite.moe.config import MoEConfig
from megalite.moe.settings import moe_layers, moe_settings
from megalite.perfmodel.flops import executed_flops
from megalite.perfmodel.fp8 import amax_bytes, layer_gemms
from megalite.perfmodel.inputs import Layout, ModelDims


@dataclass(frozen=True)
class Fp8Module:
    """One module `enable_fp8` decides on: a linear (`kind` column / row) or a layer's routed experts."""

    name: str              # as enable_fp8 returns it, e.g. "layers.1.mlp.experts"
    kind: str              # "column" | "row" | "experts"
    fp8: bool
    weights: int           # logical weights (experts: all E experts' up and down)
    flops: float           # hardware FLOPs per token, no recompute (experts: the k a token uses)
    fp8_flops: float       # of those, FP8 FLOPs (0 when not fp8)
    forward_flops: float   # the forward's share (re-run by full recompute), all FP8 when fp8


def model_dims(m: ModelSpec) -> ModelDims:
    """The dense shape of model config `m` (the attention and the dense layers' MLP)."""
    return ModelDims(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                     vocab_size=m.vocab_size, seq_len=m.seq_len, arch=m.arch, num_kv_heads=m.num_kv_heads,
                     ffn_hidden_size=m.ffn_hidden_size, tie_embeddings=bool(m.tie_embeddings),
                     make_vocab_divisible_by=m.make_vocab_divisible_by or 1)


def _linear(prefix: str, g: Gemm) -> Fp8Module:
    f = linear_flops(g.weights, g.fp8)
    return Fp8Module(prefix + g.name, g.kind, g.fp8, g.weights, f.flops, f.fp8_flops, f.forward_flops)


def _shared_gemms(m: ModelSpec, s: MoEConfig, min_dim: int) -> list[Gemm]:
    return shared_expert_gemms(m.hidden_size, s.shared_experts * s.shared_ffn_hidden_size, m.arch == "llama", min_dim)


def _layer_linears(m: ModelSpec, s: MoEConfig | None, is_moe: bool, min_dim: int) -> list[Gemm]:
    """A layer's linears: a dense layer's four; a MoE layer's attention two and its shared experts' two."""
    dense = layer_gemms(model_dims(m), min_dim)
    if not is_moe:
        return dense
    assert s is not None
    return [g for g in dense if g.name.startswith("attn.")] + (_shared_gemms(m, s, min_dim) if s.shared_experts else [])


def fp8_modules(m: ModelSpec, min_dim: int) -> list[Fp8Module]:
    """Every block linear and routed-expert module of model config `m` and the filter's choice for each."""
    s, moe = moe_settings(m), set(moe_layers(m))
    out: list[Fp8Module] = []
    for i in range(m.num_layers):
        p = f"layers.{i}."
        out += [_linear(p, g) for g in _layer_linears(m, s, i in moe, min_dim)]
        if i in moe:
            assert s is not None
            one, k = (3 if m.arch == "llama" else 2) * m.hidden_size * s.ffn_hidden_size, s.top_k
            fp8 = fp8_filter(p + "mlp.experts", m.hidden_size, [s.ffn_hidden_size], min_dim)  # enable_fp8's rule
            f = expert_flops(one, k, fp8)
            out.append(Fp8Module(p + "mlp.experts", "experts", fp8, s.experts * one, f.flops, f.fp8_flops,
                                 f.forward_flops))
    return out


def active_hardware_flops(m: ModelSpec, recompute: str) -> float:
    """Hardware FLOPs per token of the model a token runs through (`flops.executed_flops`): the block modules of
    `fp8_modules` (experts: the k it is routed to), the routers (E h each) and the head (V h)."""
    s = moe_settings(m)
    routers = (s.experts * m.hidden_size * len(moe_layers(m))) if s is not None else 0
    layer_weights = sum(mod.flops for mod in fp8_modules(m, 1)) / 6.0 + routers
    dims = model_dims(m)
    attn = float(dims.num_layers) * dims.num_heads * dims.hd * dims.seq_len
    return executed_flops(layer_weights, dims.vocab_size * m.hidden_size, attn, recompute)


@dataclass
class MoEFp8Estimate:
    """The FP8 figures of a MoE model at one layout (per device; bytes per step)."""

    recipe: str
    min_dim: int
    fp8_modules: list[str]          # the names enable_fp8 returns
    expert_modules: int             # of those, routed-expert modules (their fprop and dgrad in FP8)
    fp8_flops_fraction: float       # of the active model's hardware FLOPs per token
    amax_bytes: dict[str, float]    # ring bytes per step of the amax all-reduces, by counter key (dense linears)
    weight_copy_bytes: float        # the largest transient e4m3 weight copy (experts: E/ep stacked)

    def to_dict(self) -> dict:
        return asdict(self)


def moe_fp8_estimate(m: ModelSpec, layout: Layout, ep: int, recipe: str, min_dim: int) -> MoEFp8Estimate:
    """What `fp8.recipe` = `recipe` runs in FP8 on MoE model config `m` (module doc for the counts)."""
    s = moe_settings(m)
    if s is None:
        raise ValueError("moe_fp8_estimate needs a MoE model (moe.experts > 0)")
    mods = fp8_modules(m, min_dim)
    full = 1.0 if layout.recompute == "full" else 0.0
    fp8_flops = sum(mod.fp8_flops + full * mod.forward_flops for mod in mods if mod.fp8)
    fraction = fp8_flops / active_hardware_flops(m, layout.recompute)
    # The amax traffic of a stage's dense FP8 linears: each layer kind's, times its layers / pp.
    moe = set(moe_layers(m))
    linears = [(g, 1.0 / layout.pp) for i in range(m.num_layers) for g in _layer_linears(m, s, i in moe, min_dim)]
    amax = amax_bytes([(g, n) for g, n in linears if g.fp8], layout, recipe, m.seq_len)
    copies = [float(g.weights // layout.tp) for g, _ in linears if g.fp8]
    if any(mod.kind == "experts" and mod.fp8 for mod in mods):
        up = (2 if m.arch == "llama" else 1) * s.ffn_hidden_size * m.hidden_size
        copies.append(float(s.experts // ep * up))
    experts = sum(mod.kind == "experts" and mod.fp8 for mod in mods)
    return MoEFp8Estimate(recipe, min_dim, [mod.name for mod in mods if mod.fp8], experts, fraction, amax,
                          max(copies, default=0.0))


def fp8_lines(est: MoEFp8Estimate, ep: int) -> list[str]:
    """tools/estimate.py's FP8 lines of the MoE section."""
    amax = ", ".join(f"{k} {v / 1e6:.3g} MB" for k, v in est.amax_bytes.items()) or "none"
    return [f"  fp8 {est.recipe} (min dim {est.min_dim}): {len(est.fp8_modules)} modules in FP8, "
            f"{est.expert_modules} of them routed experts (fprop and dgrad; wgrad in the run dtype): "
            f"{est.fp8_flops_fraction:.1%} of the active model's hardware FLOPs",
            f"  fp8 amax all-reduces (dense linears; experts reduce none): {amax} per step; largest e4m3 weight "
            f"copy {est.weight_copy_bytes / 1e6:.3g} MB (an expert module's E/ep={ep} stacked experts at most)"]
