"""Generic helpers behind `megalite.config`: value coercion, argv splitting, TOML reading, `--help`.

Nothing here knows megalite's sections: every function takes the dataclasses (or their field
types) as arguments, so the schema, presets and rules (`schema.py`, `presets.py`, `validate.py`)
import this module without an import cycle and stay readable lists.

The CLI grammar follows torchtitan's generated CLI: `--section.field VALUE` or
`--section.field=VALUE`, bools spelled true/false/1/0/yes/no (a bare `--parallel.sp` means true),
lists comma-separated. Values from TOML are already typed and are checked strictly (a string where
an int belongs is an error, not a silent conversion), while CLI values are strings and parsed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megalite.errors import ConfigError
from megalite.untrusted import loads_toml

try:  # Python >= 3.11 ships tomllib; pyproject pulls tomli for 3.10.
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_TRUE = frozenset({"true", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "0", "no", "n", "off"})
_NONE = frozenset({"none", "null", "auto", ""})


# ----------------------------------------------------------------------------- field types


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (annotations are strings under __future__)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    """Short human name of a field type for `--help` and error messages: int, list[str], bool | None."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for `X | None` / Optional[X]; other types pass through."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _scalar(key: str, value: Any, tp: type, from_cli: bool) -> Any:
    """Convert one scalar to `tp`, or raise ConfigError('key: expected T, got V')."""
    bad = ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if from_cli:
        text = str(value).strip()
        if tp is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ConfigError(f"{key}: expected bool (true/false/1/0/yes/no), got {value!r}")
        if tp is str:
            return str(value)
        try:
            return tp(text)
        except ValueError:
            raise bad from None
    # Typed sources (TOML, dicts): bool is a subclass of int in Python, so reject it explicitly;
    # an int is accepted where a float belongs (TOML writes `lr = 1` for 1.0).
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(value, bool):
        raise bad
    if tp is float and isinstance(value, int):
        return float(value)
    if isinstance(value, tp):
        return value
    raise bad


def coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert `value` (a CLI string when `from_cli`, else a TOML/dict value) to field type `tp`.

    Supported types are the ones megalite's config uses: int, float, str, bool, `bool | None`
    and `list[X]` of those scalars. CLI lists are comma-separated ("" is the empty list); a single
    TOML scalar where a list belongs is taken as a one-element list.
    """
    inner, optional = _split_optional(tp)
    if optional:
        if value is None or (from_cli and str(value).strip().lower() in _NONE):
            return None
        return coerce(key, value, inner, from_cli)
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner)
        if from_cli:
            items: list[Any] = [p.strip() for p in str(value).split(",") if p.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        return [_scalar(f"{key}[{i}]", v, elem, from_cli) for i, v in enumerate(items)]
    return _scalar(key, value, inner, from_cli)


# ----------------------------------------------------------------------------- suggestions


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice by difflib ratio, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_key_message(key: str, sections: dict[str, type]) -> str:
    """Explain an unknown `section.field` key with the closest known key or section."""
    all_keys = [f"{s}.{f.name}" for s, cls in sections.items() for f in dataclasses.fields(cls)]
    section, dot, name = key.partition(".")
    if not dot:
        # A bare field name ("lr"): suggest the section-qualified key(s) that end with it.
        owners = [k for k in all_keys if k.split(".", 1)[1] == key]
        hint = f" (did you mean '{owners[0]}'?)" if owners else did_you_mean(key, all_keys)
        return f"unknown config key '{key}'{hint}: keys are written section.field"
    if section not in sections:
        hint = did_you_mean(section, sections)
        return (f"unknown config section '{section}' in '{key}'{hint}; "
                f"sections are: {', '.join(sections)}")
    return f"unknown config key '{key}'{did_you_mean(key, all_keys)}"


# ----------------------------------------------------------------------------- argv and TOML


@dataclasses.dataclass
class ParsedArgv:
    """argv split into its parts; `overrides` keeps CLI order so that a repeated key's last value wins."""

    config_file: str | None = None
    want_help: bool = False
    overrides: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def split_argv(argv: Sequence[str], bool_keys: set[str]) -> ParsedArgv:
    """Split argv into --config, --help and (key, raw value) overrides; raise ConfigError on junk.

    `bool_keys` lists the keys that may appear as bare flags (`--parallel.sp` = true). Dashes in
    field names are accepted as underscores (`--train.micro-batch-size`).
    """
    out = ParsedArgv()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            out.want_help = True
            continue
        if not arg.startswith("--") or len(arg) == 2:
            after = f" (after --{out.overrides[-1][0]} {out.overrides[-1][1]})" if out.overrides else ""
            raise ConfigError(f"unexpected argument {arg!r}{after}: options look like --section.field VALUE, and a "
                              "list is one comma-separated value (--data.path a.jsonl,data/web)")
        name, eq, value = arg[2:].partition("=")
        if "." in name:
            section, _, fname = name.partition(".")
            name = f"{section}.{fname.replace('-', '_')}"
        if not eq:
            next_is_value = i < len(argv) and not argv[i].startswith("--")
            if next_is_value:
                value = argv[i]
                i += 1
            elif name in bool_keys:
                value = "true"
            else:
                raise ConfigError(f"--{name} needs a value: write --{name} VALUE or --{name}=VALUE")
        if name == "config":
            if out.config_file is not None:
                raise ConfigError("--config given twice: pass one TOML file and override keys with --section.field")
            out.config_file = value
        else:
            out.overrides.append((name, value))
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """Load a TOML file, turning a missing file or bad syntax into a ConfigError."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            text = fh.read().decode("utf-8")
        return loads_toml(text, f"config file '{p}'", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"config file '{p}' not found: check the path given to --config") from None
    except IsADirectoryError:
        raise ConfigError(f"config file '{p}' is a directory: give --config a .toml file") from None
    except OSError as exc:
        raise ConfigError(f"config file '{p}' cannot be read ({exc.strerror or exc}): check its permissions") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML ({exc}): fix its syntax") from None


# ----------------------------------------------------------------------------- building a config

Entry = tuple[str, Any, bool]
"""One value to apply: ("section.field", value, from_cli). Later entries override earlier ones."""


def sections_of(config_cls: type) -> dict[str, type]:
    """section name -> section dataclass, in the top-level dataclass's field order."""
    return {f.name: f.default_factory for f in dataclasses.fields(config_cls)}  # type: ignore[misc]


def flatten(d: Mapping[str, Any], sections: dict[str, type], source: str, errors: list[str]) -> list[Entry]:
    """A nested {section: {field: value}} dict (a TOML file) as ordered entries; bad layout goes to `errors`."""
    entries: list[Entry] = []
    for section, table in d.items():
        if section not in sections:
            first = next(iter(table), None) if isinstance(table, Mapping) else None
            errors.append(unknown_key_message(f"{section}.{first}" if first else section, sections))
        elif not isinstance(table, Mapping):
            errors.append(f"'{section}' in {source} must be a table ([{section}]), got {table!r}")
        else:
            entries += [(f"{section}.{k}", v, False) for k, v in table.items()]
    return entries


def check_preset(name: Any, presets: Mapping[str, Any]) -> str:
    """`name` if it is a preset, else a ConfigError that lists them all."""
    if not isinstance(name, str) or name not in presets:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(str(name), presets)}: "
                          f"model.preset must be one of {', '.join(presets)}")
    return name


def build(config_cls: type, presets: Mapping[str, Mapping[str, Any]], entries: list[Entry],
          errors: list[str]) -> Any:
    """defaults < preset < entries, in order; every unknown key or bad value is appended to `errors`.

    A preset holds model fields, and other sections' fields as tables (`moe={...}`).

    The preset is the last `model.preset` among the entries (the CLI's come after the file's), so
    `--model.preset llama-1b` replaces the model defaults *under* the file's explicit model values.
    """
    cfg = config_cls()
    chosen: Any = cfg.model.preset
    for key, value, _ in entries:
        if key == "model.preset":
            chosen = value
    try:
        for k, v in presets[check_preset(chosen, presets)].items():
            if isinstance(v, Mapping):  # another section's values ({"moe": {"experts": 8, ...}})
                for name, value in v.items():
                    setattr(getattr(cfg, k), name, value)
            else:
                setattr(cfg.model, k, v)
    except ConfigError as exc:
        errors.append(str(exc))
    sections = sections_of(config_cls)
    types_ = {s: field_types(c) for s, c in sections.items()}
    for key, value, from_cli in entries:
        section, _, name = key.partition(".")
        if section not in types_ or name not in types_[section]:
            errors.append(unknown_key_message(key, sections))
            continue
        if key == "model.preset" and not (isinstance(value, str) and value in presets):
            continue  # reported above if it was the chosen one; else a later valid preset overrides it
        try:
            setattr(getattr(cfg, section), name, coerce(key, value, types_[section][name], from_cli))
        except ConfigError as exc:
            errors.append(str(exc))
    return cfg


def raise_if(errors: list[str], what: str) -> None:
    """Raise one ConfigError listing every problem (one line each), if there are any."""
    if len(errors) == 1:
        raise ConfigError(f"{what}: {errors[0]}")
    if errors:
        raise ConfigError(f"{what} ({len(errors)} problems):\n" + "\n".join(f"  - {e}" for e in errors))


# ----------------------------------------------------------------------------- --help


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return '""' if f.default == "" else repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


HELP_WIDTH = 120  # docs/config.md's copy; `--help` wraps to the terminal instead (`terminal_width`)

# The flags pretrain.py reads before the config (megalite/training/preflight.py): launchers use them.
COMMAND_FLAGS = (
    ("--check-config", "validate the config and its predicted memory in one process, print both, exit (0 = ok); "
                       "launch/torchrun.sh and launch/slurm.sbatch run it before starting workers"),
    ("--world-size N", "with --check-config: the processes the launcher will start (default 1)"),
    ("--local-processes N", "with --check-config: how many of them share this machine (default: --world-size)"),
    ("--config FILE.toml", "read a config file (a run's saved config.toml, configs/*.toml)"),
    ("--help, -h", "this text"),
)


def terminal_width() -> int:
    """The terminal's columns (COLUMNS when set), at least 60; HELP_WIDTH when not a terminal."""
    import shutil

    return max(60, shutil.get_terminal_size((HELP_WIDTH, 24)).columns)


def _entry(name: str, middle: str, doc: str, width: int) -> list[str]:
    """`  NAME  MIDDLE  doc`, the doc wrapped under the type column (or 6 spaces in on a narrow terminal)."""
    import textwrap

    head = f"  {name:<32} {middle}".rstrip() if middle else f"  {name:<31}"
    indent = " " * (35 if width >= 100 else 6)
    return textwrap.wrap(f"{head}  {doc}" if doc else head, width, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False, drop_whitespace=True) or [head]


def format_help(sections: dict[str, type], section_docs: dict[str, str], presets: Iterable[str],
                width: int = HELP_WIDTH) -> str:
    """The pretrain.py flags, then every field grouped by section: `--section.field  TYPE  (default D)  doc`,
    each entry wrapped at `width`."""
    import textwrap

    lines = [
        "usage: pretrain.py [--config FILE.toml] [--section.field VALUE ...]",
        "       pretrain.py --check-config [--world-size N] [--local-processes N] [--section.field VALUE ...]",
        "",
        "Precedence: defaults < model.preset < --config file < command line.",
        "Bools: true/false/1/0/yes/no (a bare flag means true). Lists: comma-separated.",
        *textwrap.wrap(f"Presets (model.preset): {', '.join(presets)}", width, subsequent_indent="  ",
                       break_on_hyphens=False),
        "",
        "[pretrain.py]  flags read before the config",
    ]
    for flag, doc in COMMAND_FLAGS:
        lines += _entry(flag, "", doc, width)
    for section, cls in sections.items():
        lines += ["", f"[{section}]  {section_docs.get(section, '')}".rstrip()]
        types_ = field_types(cls)
        for f in dataclasses.fields(cls):
            lines += _entry(f"--{section}.{f.name}", f"{type_name(types_[f.name]):<12} (default {_default_text(f)})",
                            f.metadata.get("doc", ""), width)
    return "\n".join(lines) + "\n"
