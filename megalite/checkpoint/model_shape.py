"""The model's shape from the checkpoint a run loads, the way `from_pretrained` takes it from config.json.

`python pretrain.py --checkpoint.load X` with no model flags builds the model X holds (a megalite
checkpoint or one imported from Hugging Face: both record their dims in index.json's "model"). A model
field given on the command line or in the --config file (directly or through --model.preset) must equal
X's value, else the run is refused with every differing field named (the `[moe]` section's fields too, recorded
in index.json as "moe_" + field): each of these changes what the
model computes, so a silent mismatch (an imported rope_theta of 500000 resumed at the default 10000)
would train a different model without a word. Fields not given are taken from X, before derived
values are filled in, so `num_kv_heads`, `ffn_hidden_size` and `tie_embeddings` are X's too.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megalite.checkpoint.layout import MOE_INFO_KEYS, ROPE_INFO_KEYS
from megalite.checkpoint.sharded import find, read_index
from megalite.config import aliases, cli, parse
from megalite.config.presets import PRESETS
from megalite.config.schema import Config
from megalite.model.pattern import VARIANT_DEFAULTS
from megalite.errors import CheckpointError

# Every recorded field that changes the computation (make_vocab_divisible_by only pads: taken, never refused).
SHAPE_FIELDS: tuple[str, ...] = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                 "ffn_hidden_size", "vocab_size", "seq_len", "tie_embeddings", "norm_eps", "rope_theta")
# A MoE model's structure and routing, and q/k norm, are refused when contradicted like the dims. The router
# losses, bias rate and capacity are training choices: taken from the checkpoint unless given, never refused.
TAKEN_FIELDS = ("make_vocab_divisible_by", "moe_bias_rate", "moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss",
                "moe_capacity_factor")
SHAPE_FIELDS += tuple(k for k in MOE_INFO_KEYS if k not in TAKEN_FIELDS) + ("qk_norm", "head_dim") + ROPE_INFO_KEYS
SHAPE_FIELDS += tuple(VARIANT_DEFAULTS)  # the layer pattern and the variants (megalite/model/pattern.py)
# "Derive me" values: given explicitly they still ask for the default, so they contradict nothing.
_DERIVED = {"head_dim": 0, "num_kv_heads": 0, "ffn_hidden_size": 0, "vocab_size": 0, "tie_embeddings": None}


def _section_and_field(info_key: str) -> tuple[str, str]:
    """Where an index.json model key lives in the config: "moe_top_k" -> ("moe", "top_k"), "arch" -> ("model",
    "arch")."""
    if info_key in MOE_INFO_KEYS:
        return "moe", info_key.removeprefix("moe_")
    return "model", info_key


def _value(cfg: Config, info_key: str) -> Any:
    section, name = _section_and_field(info_key)
    return getattr(getattr(cfg, section), name)


def _shown(info_key: str) -> str:
    return ".".join(_section_and_field(info_key))


def explicit_model_fields(argv: list[str] | None, cfg: Config) -> set[str]:
    """The model fields (as index.json keys) the user gave: on the command line, in the --config file, or through
    a given preset; old names (`aliases.RENAMED`) count as their new ones."""
    args = sys.argv[1:] if argv is None else list(argv)
    parsed = cli.split_argv(args, parse.bool_keys())
    given = {aliases.new_name(key) for key, _ in parsed.overrides}
    if parsed.config_file is not None:
        table = aliases.upgrade(cli.read_toml(parsed.config_file))[0]
        given |= {f"{s}.{k}" for s in ("model", "moe") if isinstance(table.get(s), dict) for k in table[s]}
    if "model.preset" in given:
        preset = PRESETS.get(cfg.model.preset, {})
        moe = preset.get("moe", {})
        given |= {f"model.{k}" for k, v in preset.items() if not isinstance(v, Mapping)}
        given |= {f"moe.{k}" for k in (moe if isinstance(moe, Mapping) else {})}
    fields = {k.removeprefix("model.") for k in given if k.startswith("model.")}
    fields |= {f"moe_{k.removeprefix('moe.')}" for k in given if k.startswith("moe.")}
    return {f for f in fields if f in SHAPE_FIELDS + TAKEN_FIELDS
            and not (f in _DERIVED and _value(cfg, f) == _DERIVED[f])}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return float(a) == float(b)
    return bool(a == b)


def apply_checkpoint_shape(cfg: Config, argv: list[str] | None, init_from: Path | None = None) -> Config:
    """`cfg` with the model shape of the checkpoint it will load (if any); a CheckpointError naming every
    field a flag contradicts. Call before `resolve` (which derives from these values). `init_from`: the
    checkpoint whose weights a fresh run starts from (`train.init_from`, resolved by the caller,
    megalite.training.init_from), whose shape it takes too when it loads none of its own."""
    path = find(cfg.checkpoint.load, cfg.checkpoint.dir) or init_from
    if path is None:
        return cfg
    saved: dict[str, Any] = read_index(path).get("model", {})
    given = explicit_model_fields(argv, cfg)
    diff = [f for f in SHAPE_FIELDS if f in given and f in saved and not _same(_value(cfg, f), saved[f])]
    if diff:
        pairs = ", ".join(f"{_shown(f)}={_value(cfg, f)!r} but the checkpoint has {saved[f]!r}" for f in diff)
        # Two ways out, and which one the user meant depends on intent: a new model wants its own
        # directory; continuing this checkpoint wants its shape, i.e. no contradicting flags.
        where = ("--checkpoint.load another checkpoint" if cfg.checkpoint.load
                 else f"give this run its own --checkpoint.dir ({cfg.checkpoint.dir!r} holds that model)")
        raise CheckpointError(f"checkpoint {path} is a different model: {pairs}; to train a new model, {where}; "
                              "to continue that checkpoint, drop these flags (its model shape is taken from it)")
    for f in SHAPE_FIELDS + TAKEN_FIELDS:
        if f in saved and f not in given:
            section, name = _section_and_field(f)
            setattr(getattr(cfg, section), name, saved[f])
    if isinstance(saved.get("mla"), dict) and not cfg.mla.enabled:  # MLA's widths too, unless [mla] is set (then
        for f, value in saved["mla"].items():                         # loading refuses a contradicting one)
            if hasattr(cfg.mla, f):
                setattr(cfg.mla, f, value)
    return cfg
