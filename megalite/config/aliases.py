"""The names config fields had before their features got sections of their own, and what they are now.

`RENAMED` is the one table (old dotted name -> new dotted name). A user's old name, on the command line or in a
`--config` file, still works and is answered by one line on stderr naming the new one (`note_renamed`: once per
name, on rank 0 only); an old and a new name set to different values are refused (`conflicts`, `argv_conflicts`); a file megalite wrote itself (a run's config.toml, a checkpoint's index.json) is mapped
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


def _spelled(d: Mapping[str, Any]) -> dict[str, Any]:
    """`d` with a dash in a field name read as an underscore (`tune-malloc` is `tune_malloc`), as on the command
    line; where both spellings are set, the underscore's value is kept (`conflicts` refuses them disagreeing)."""
    out: dict[str, Any] = {}
    for section, table in d.items():
        if not isinstance(table, Mapping):
            out[section] = table
            continue
        folded = {k.replace("-", "_"): v for k, v in table.items() if "-" in k}
        out[section] = {**folded, **{k: v for k, v in table.items() if "-" not in k}}
    return out


def upgrade(d: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A nested {section: {field: value}} dict with every old name moved to its new place, and the old names
    found (in order). Where both names are set, the new name's value is kept: the callers that read a user's file
refuse a disagreement first (`conflicts`), so that happens only where they agree. Dashed field names are read
as underscored ones (`_spelled`)."""
    d = _spelled(d)
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


def conflicts(d: Mapping[str, Any], where: str) -> list[str]:
    """One line per field `d` (a nested {section: {field: value}} dict) sets under both its old and its new name
    to different values: neither is taken over the other (which one the user meant is theirs to say); the same for
    a field spelled with dashes and with underscores."""
    out: list[str] = []
    for section, table in d.items():
        if not isinstance(table, Mapping):
            continue
        for name, value in table.items():
            other = name.replace("-", "_")
            if other != name and other in table and table[other] != value:
                out.append(f"{where} sets {section}.{name} = {value!r} and {section}.{other} = {table[other]!r}, one "
                           f"field spelled two ways: keep one ({other})")
    for section, table in _spelled(d).items():
        if not isinstance(table, Mapping):
            continue
        for name, value in table.items():
            new = RENAMED.get(f"{section}.{name}")
            if new is None:
                continue
            new_section, _, new_field = new.partition(".")
            target = d.get(new_section)
            if isinstance(target, Mapping) and new_field in target and target[new_field] != value:
                out.append(f"{where} sets {section}.{name} = {value!r} and {new} = {target[new_field]!r}, the same "
                           f"field under its old and its new name: keep one ({new_field} under [{new_section}])")
    return out


def argv_conflicts(overrides: Iterable[tuple[str, str]]) -> list[str]:
    """One line per field given on the command line under its old and its new name with different values."""
    seen: dict[str, tuple[str, str]] = {}
    out: list[str] = []
    for key, value in overrides:
        new = new_name(key)
        if new in seen and seen[new][0] != key and seen[new][1] != value:
            out.append(f"--{seen[new][0]} {seen[new][1]} and --{key} {value} are the same field ({new}) under its "
                       f"old and its new name, with different values: give --{new} once")
        seen[new] = (key, value)
    return out


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
