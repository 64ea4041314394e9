"""Validation of the layer pattern and the attention / MLP variant fields (`model.layer_types`, sliding_window,
attn_sinks, ...; their meaning: megalite/model/pattern.py, docs/attention.md), apart from the other rules so that
each concern keeps one home. `validate.py` adds these lines to its list."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from megalite.config.cli import coerce, field_types
from megalite.config.schema import Config, ModelArgs, ModelConfig
from megalite.errors import ConfigError
from megalite.model.pattern import (KIMI_DELTA, LINEAR, MAMBA, VARIANT_DEFAULTS, is_uniform, layer_costs,
                                    linear_dims, pattern_problems,
                                    variant_layout_problems)


def layer_problems(cfg: Config) -> list[str]:
    """One line per bad layer-pattern or variant field, against the model and the parallel layout."""
    m = cfg.model
    if m.num_heads < 1 or m.hidden_size < 1:
        return []  # said by the size rules; the head width is not defined
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    out = pattern_problems(m, head_dim)
    if LINEAR in m.layer_types and cfg.fp8.recipe != "none" and not out:  # the shapes are sound
        out += _linear_fp8_problems(cfg, head_dim)
    out += variant_layout_problems(m, cfg.parallel.tp, cfg.mla.enabled, cfg.mtp.num_layers)
    if LINEAR in m.layer_types and cfg.parallel.cp > 1:
        out += _linear_cp_problems(cfg)
    no_cp = [k for k in (KIMI_DELTA, MAMBA) if k in m.layer_types]
    if no_cp and cfg.parallel.cp > 1:
        # Gated DeltaNet's state passing is tested in a model (above); KDA's per-channel decay and Mamba2's write
        # without the erase are not yet (megalite/recurrent/state_passing.py).
        out.append(f"parallel.cp={cfg.parallel.cp} with {' and '.join(no_cp)} layers is not supported yet: set "
                   "parallel.cp=1")
    if cfg.moe.router_bias and not cfg.moe.experts:
        out.append("moe.router_bias needs a mixture-of-experts model (moe.experts > 0)")
    if cfg.moe.shared_gate and not (cfg.moe.experts and cfg.moe.shared_experts):
        out.append("moe.shared_gate gates the shared experts: it needs moe.experts > 0 and moe.shared_experts > 0")
    return out


def _linear_cp_problems(cfg: Config) -> list[str]:
    """Linear layers under context parallelism run by state passing (megalite/recurrent/state_passing.py) beside the
    full layers' cp mode: each zigzag slice (seq_len / 2 cp tokens) takes its conv window's past from the slice
    before it only, so a slice must hold the window's W - 1 inputs."""
    m, cp = cfg.model, cfg.parallel.cp
    slice_len, past = m.seq_len // (2 * cp), m.linear_conv_kernel_dim - 1
    if m.seq_len % (2 * cp) == 0 and slice_len < past:
        return [f"parallel.cp={cp} with linear_attention layers cuts model.seq_len {m.seq_len} into zigzag slices "
                f"of {slice_len} tokens, fewer than the conv window's {past} past inputs "
                f"(linear_conv_kernel_dim - 1): use seq_len >= {2 * cp * past} or a smaller cp"]
    return []


def _linear_fp8_problems(cfg: Config, head_dim: int) -> list[str]:
    """A block recipe's blocks on the linear layers' projections at tp (in_proj's six parts, out_proj's input), as
    megalite/fp8/config.py's `layout_problems` holds the attention's and the MLP's; the filter (`fp8.min_dim` against
    every part, the gates' H included) decides which of the two run in FP8."""
    from megalite.fp8.checks import block_layout_problems
    from megalite.fp8.costs import Gemm, fp8_filter

    m, min_dim = cfg.model, cfg.fp8.min_dim
    d = linear_dims(m, head_dim)
    shapes = [("attn.gdn.in_proj", m.hidden_size, (d.key_dim, d.key_dim, d.value_dim, d.value_dim, d.value_heads,
                                                   d.value_heads), "column"),
              ("attn.gdn.out_proj", d.value_dim, (m.hidden_size,), "row")]
    gemms = [Gemm(n, i, o, k, fp8_filter(n, i, list(o), min_dim)) for n, i, o, k in shapes]
    return block_layout_problems(cfg.fp8.recipe, gemms, cfg.parallel.tp, 1, m.seq_len)


def variant_info_problems(info: dict[str, Any]) -> list[str]:
    """The layer-pattern and variant fields a checkpoint's model info records (index.json "model", untrusted: maybe
    hand-edited), with the config's own types and rules; `info`'s dims are already checked."""
    types = field_types(ModelConfig)
    values: dict[str, Any] = {}
    out: list[str] = []
    for key in VARIANT_DEFAULTS:
        if key in info:
            try:
                values[key] = coerce(f"model.{key}", info[key], types[key], from_cli=False)
            except ConfigError as e:
                out.append(str(e))
    if out or not values:
        return out
    dims = {k: info[k] for k in ("arch", "num_layers", "num_heads", "hidden_size")}
    m = SimpleNamespace(**{**VARIANT_DEFAULTS, **values, **dims})
    return pattern_problems(m, info.get("head_dim") or info["hidden_size"] // info["num_heads"])


def balanced_pp_layers(cfg: Config) -> list[int]:
    """parallel.pp_layers that balance the stages by each layer's cost (`pattern.layer_costs`) when the layers
    differ and pp x vpp > 1 (`derive.resolve` fills an empty pp_layers with it); [] otherwise: the even split, or a
    config too broken to price (validation reports it)."""
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.vpp
    if stages <= 1 or m.num_layers < stages or m.num_heads < 1 or m.hidden_size < 1 or is_uniform(m):
        return []
    if pattern_problems(m, m.head_dim or m.hidden_size // m.num_heads):
        return []
    from megalite.pipeline.partition import balanced_counts

    return balanced_counts(layer_costs(ModelArgs.of(m, cfg.moe, cfg.mla, cfg.mtp)), stages)
