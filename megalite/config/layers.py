"""Validation of the layer pattern and the attention / MLP variant fields (`model.layer_types`, sliding_window,
attn_sinks, ...; their meaning: megalite/model/pattern.py, docs/attention.md), apart from the other rules so that
each concern keeps one home. `validate.py` adds these lines to its list."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from megalite.config.cli import coerce, field_types
from megalite.config.schema import Config, ModelArgs, ModelConfig
from megalite.errors import ConfigError
from megalite.model.pattern import (VARIANT_DEFAULTS, has_linear, is_uniform, layer_costs, pattern_problems,
                                    variant_layout_problems)


def layer_problems(cfg: Config) -> list[str]:
    """One line per bad layer-pattern or variant field, against the model and the parallel layout."""
    m = cfg.model
    if m.num_heads < 1 or m.hidden_size < 1:
        return []  # said by the size rules; the head width is not defined
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    out = pattern_problems(m, head_dim)
    out += variant_layout_problems(m, cfg.parallel.tp, cfg.mla.enabled, cfg.mtp.num_layers)
    if has_linear(m) and cfg.parallel.cp > 1:
        # The layer has cp by state passing (megalite/recurrent/state_passing.py), but its composition with the
        # full layers' cp modes in one model is not tested yet.
        out.append(f"parallel.cp={cfg.parallel.cp} with linear_attention layers is not supported yet: set "
                   "parallel.cp=1")
    if cfg.moe.router_bias and not cfg.moe.experts:
        out.append("moe.router_bias needs a mixture-of-experts model (moe.experts > 0)")
    return out


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
