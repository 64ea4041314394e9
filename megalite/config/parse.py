"""Building a Config: defaults < model.preset < TOML file (--config) < command line.

Every unknown key and bad value is reported together in one ConfigError; `--help` prints every field.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import tomli_w

from megalite.config import aliases, cli
from megalite.config.presets import PRESETS
from megalite.config.schema import Config


def _sections() -> dict[str, type]:
    return cli.sections_of(Config)


def bool_keys() -> set[str]:
    """The keys that may be given as bare flags (`--parallel.sp` = true), their old names included."""
    keys = {f"{s}.{n}" for s, c in _sections().items() for n, t in cli.field_types(c).items()
            if "bool" in cli.type_name(t)}
    return keys | {old for old, new in aliases.RENAMED.items() if new in keys}


def config_from_dict(d: dict[str, Any]) -> Config:
    """A Config from a nested dict as read from TOML: defaults < d's preset < d's values. Old field names
    (`aliases.RENAMED`: a config.toml saved before the feature sections) are mapped silently."""
    errors: list[str] = aliases.conflicts(d, "the config")
    entries = cli.flatten(aliases.upgrade(d)[0], _sections(), "the config", errors)
    cfg = cli.build(Config, PRESETS, entries, errors)
    cli.raise_if(errors, "bad config")
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    """A Config from a TOML file (e.g. a run's saved `config.toml`)."""
    return config_from_dict(cli.read_toml(Path(path)))


def help_text(width: int = cli.HELP_WIDTH) -> str:
    """The `--help` text: every field by section with its type, default and doc, wrapped at `width`
    (docs/config.md holds it at the default width; `--help` wraps it to the terminal)."""
    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(Config)}
    return cli.format_help(_sections(), docs, PRESETS, width)


def parse_args(argv: list[str] | None = None) -> Config:
    """Build a Config from `--config FILE.toml` and `--section.field VALUE` overrides.

    Precedence: defaults < preset (model.preset from the CLI, else the file, else "tiny") < file
    < CLI. Every unknown key and bad value is reported in one ConfigError. `--help` prints
    `help_text()` and exits 0. An old field name (`aliases.RENAMED`) works, with one note naming the new one.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    sections = _sections()
    parsed = cli.split_argv(args, bool_keys())
    if parsed.want_help:
        print(help_text(cli.terminal_width()), end="")
        raise SystemExit(0)
    errors: list[str] = []
    entries: list[cli.Entry] = []
    old: list[str] = []
    if parsed.config_file is not None:
        raw = cli.read_toml(parsed.config_file)
        errors += aliases.conflicts(raw, parsed.config_file)
        table, old = aliases.upgrade(raw)
        entries += cli.flatten(table, sections, parsed.config_file, errors)
    errors += aliases.argv_conflicts(parsed.overrides)
    old += [k for k, _ in parsed.overrides if k in aliases.RENAMED]
    entries += [(aliases.new_name(k), v, True) for k, v in parsed.overrides]
    cfg = cli.build(Config, PRESETS, entries, errors)
    cli.raise_if(errors, "bad config")
    aliases.note_renamed(old)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain dict of `cfg`, None values dropped (TOML has no null; None means 'default')."""
    return {s: {k: v for k, v in sec.items() if v is not None} for s, sec in dataclasses.asdict(cfg).items()}


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write `cfg` as TOML, creating parent directories; atomic so a crash never leaves half a file, and never
    through a link (`megalite.atomic.write_atomic`). The text is encoded before any file exists."""
    from megalite.atomic import write_atomic
    from megalite.errors import ConfigError

    data = tomli_w.dumps(config_to_dict(cfg)).encode("utf-8")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, data, ConfigError)
