"""The model's shape from the checkpoint a run loads, the way `from_pretrained` takes it from config.json.

`python pretrain.py --checkpoint.load X` with no model flags builds the model X holds (a megalite
checkpoint or one imported from Hugging Face: both record their dims in index.json's "model"). A model
field given on the command line or in the --config file (directly or through --model.preset) must equal
X's value, else the run is refused with every differing field named: each of these changes what the
model computes, so a silent mismatch (an imported rope_theta of 500000 resumed at the default 10000)
would train a different model without a word. Fields not given are taken from X, before derived
values are filled in, so `num_kv_heads`, `ffn_hidden_size` and `tie_embeddings` are X's too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megalite.checkpoint.layout import MOE_INFO_KEYS, ROPE_INFO_KEYS
from megalite.checkpoint.sharded import find, read_index
from megalite.config import cli
from megalite.config.presets import PRESETS, section_values
from megalite.config.schema import Config
from megalite.errors import CheckpointError

# Every recorded field that changes the computation (make_vocab_divisible_by only pads: taken, never refused).
SHAPE_FIELDS: tuple[str, ...] = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                 "ffn_hidden_size", "vocab_size", "seq_len", "tie_embeddings", "norm_eps", "rope_theta")
# A MoE model's structure and routing, and q/k norm, are refused when contradicted like the dims. The router
# losses, bias rate and capacity are training choices: taken from the checkpoint unless given, never refused.
TAKEN_FIELDS = ("make_vocab_divisible_by", "moe_bias_rate", "moe_aux_loss", "moe_z_loss", "moe_capacity_factor")
SHAPE_FIELDS += tuple(k for k in MOE_INFO_KEYS if k not in TAKEN_FIELDS) + ("qk_norm", "head_dim") + ROPE_INFO_KEYS
# "Derive me" values: given explicitly they still ask for the default, so they contradict nothing.
_DERIVED = {"head_dim": 0, "num_kv_heads": 0, "ffn_hidden_size": 0, "vocab_size": 0, "tie_embeddings": None}


def explicit_model_fields(argv: list[str] | None, cfg: Config) -> set[str]:
    """model.* fields the user gave: on the command line, in the --config file, or through a given preset."""
    args = sys.argv[1:] if argv is None else list(argv)
    sections = cli.sections_of(Config)
    bool_keys = {f"{s}.{n}" for s, c in sections.items() for n, t in cli.field_types(c).items()
                 if "bool" in cli.type_name(t)}
    parsed = cli.split_argv(args, bool_keys)
    fields = {key.partition(".")[2] for key, _ in parsed.overrides if key.startswith("model.")}
    if parsed.config_file is not None:
        table = cli.read_toml(parsed.config_file).get("model", {})
        fields |= set(table) if isinstance(table, dict) else set()
    if "preset" in fields:
        fields |= set(section_values(PRESETS.get(cfg.model.preset, {})))
    return {f for f in fields if f in SHAPE_FIELDS + TAKEN_FIELDS
            and not (f in _DERIVED and getattr(cfg.model, f) == _DERIVED[f])}


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
    diff = [f for f in SHAPE_FIELDS if f in given and f in saved and not _same(getattr(cfg.model, f), saved[f])]
    if diff:
        pairs = ", ".join(f"model.{f}={getattr(cfg.model, f)!r} but the checkpoint has {saved[f]!r}" for f in diff)
        # Two ways out, and which one the user meant depends on intent: a new model wants its own
        # directory; continuing this checkpoint wants its shape, i.e. no contradicting flags.
        where = ("--checkpoint.load another checkpoint" if cfg.checkpoint.load
                 else f"give this run its own --checkpoint.dir ({cfg.checkpoint.dir!r} holds that model)")
        raise CheckpointError(f"checkpoint {path} is a different model: {pairs}; to train a new model, {where}; "
                              "to continue that checkpoint, drop these flags (its model shape is taken from it)")
    for f in SHAPE_FIELDS + TAKEN_FIELDS:
        if f in saved and f not in given:
            setattr(cfg.model, f, saved[f])
    if isinstance(saved.get("mla"), dict) and not cfg.mla.enabled:  # MLA's widths too, unless [mla] is set (then
        for f, value in saved["mla"].items():                         # loading refuses a contradicting one)
            if hasattr(cfg.mla, f):
                setattr(cfg.mla, f, value)
    return cfg
