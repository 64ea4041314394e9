"""The names config fields had before their features got sections of their own, and what they are now.

`RENAMED` is the one table (old dotted name -> new dotted name). A user's old name, on the command line or in a
`--config` file, still works and is answered by one line on stderr naming the new one (`note_renamed`: once per
name, on rank 0 only); a file megalite wrote itself (a run's config.toml, a checkpoint's index.json) is mapped
silently (`upgrade`), so every run and checkpoint of before keeps loading.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

_MOE = ("experts", "top_k", "ffn_hidden_size", "shared_experts", "shared_ffn_hidden_size", "first_dense", "every",
        "router", "renorm", "route_scale", "groups", "group_top_k", "bias_rate", "aux_loss", "z_loss",
        "capacity_factor", "seq_aux_loss")

RENAMED: Mapping[str, str] = types.MappingProxyType({
    **{f"model.moe_{name}": f"moe.{name}" for name in _MOE},
    "train.fp8": "fp8.recipe",
    "train.fp8_min_dim": "fp8.min_dim",
    "train.optimizer": "optimizer.name",
    **{f"train.{name}": f"optimizer.{name}" for name in ("weight_decay", "beta1", "beta2", "adam_eps")},
    **{f"train.muon_{name}": f"muon.{name}" for name in ("momentum", "nesterov", "ns_steps", "rms")},
})


def new_name(key: str) -> str:
    """The current dotted name of `key` ("model.moe_top_k" -> "moe.top_k"); other keys pass through."""
    return RENAMED.get(key, key)


def upgrade(d: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A nested {section: {field: value}} dict with every old name moved to its new place, and the old names
    found (in order). A value under the new name wins over the same field's old name."""
    out: dict[str, Any] = {s: dict(t) if isinstance(t, Mapping) else t for s, t in d.items()}
    found: list[str] = []
    for section, table in d.items():
        if not isinstance(table, Mapping):
            continue
        for name, value in table.items():
            old = f"{section}.{name}"
            if old not in RENAMED:
                continue
            found.append(old)
            del out[section][name]
            new_section, _, new_field = RENAMED[old].partition(".")
            target = out.setdefault(new_section, {})
            if isinstance(target, dict):
                target.setdefault(new_field, value)
    return out, found


def saved_config(extra: Any) -> dict[str, Any]:
    """The run config a checkpoint's extra state holds (`extra["config"]`), old names moved to their sections;
    {} when there is none (an imported model)."""
    config = extra.get("config") if isinstance(extra, Mapping) else None
    return upgrade(config)[0] if isinstance(config, Mapping) else {}


def note_renamed(old_names: Iterable[str]) -> None:
    """One stderr line per old name used, naming the new one; on rank 0 only (every rank parses the same argv)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for old in dict.fromkeys(old_names):  # once per name, in order of first use
        new = RENAMED[old]
        section, _, name = new.partition(".")
        print(f"note: config key {old} is now {new} (--{new}, or {name} under [{section}]); the old name still "
              "works", file=sys.stderr)
