"""Validation of the layer pattern and the attention / MLP variant fields (`model.layer_types`, sliding_window,
attn_sinks, ...; their meaning: megalite/model/pattern.py, docs/attention.md), apart from the other rules so that
each concern keeps one home. `validate.py` adds these lines to its list."""

from __future__ import annotations

from megalite.config.schema import Config
from megalite.model.pattern import pattern_problems, variant_layout_problems


def layer_problems(cfg: Config) -> list[str]:
    """One line per bad layer-pattern or variant field, against the model and the parallel layout."""
    m = cfg.model
    if m.num_heads < 1 or m.hidden_size < 1:
        return []  # said by the size rules; the head width is not defined
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    out = pattern_problems(m, head_dim)
    out += variant_layout_problems(m, cfg.parallel.tp, cfg.mla.enabled, cfg.mtp.num_layers)
    if cfg.moe.router_bias and not cfg.moe.experts:
        out.append("moe.router_bias needs a mixture-of-experts model (moe.experts > 0)")
    return out
