"""Field checks `validate` runs besides its own (kept apart so the layout rules stay readable there):
text fields a file system or TOML cannot hold, and the fields only read late in a run.

Every field is checked before any process group, dataset or model exists, so no value can fail after
step 1 (`--logging.sample_interval 1 --logging.sample_tokens -1` used to crash at the first sample) or
when config.toml is saved (a NUL byte or a non-UTF-8 byte in `logging.dir`, `checkpoint.dir` or
`logging.sample_prompt` cannot be written as TOML, nor passed to the operating system as a path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megalite.config.schema import Config

MAX_SEED = 2**64  # torch and numpy take unsigned 64-bit seeds
MAX_COUNT = 2**62  # steps, intervals: a count no run reaches, that stays exact in float64 arithmetic


def _text_problem(key: str, value: str) -> str | None:
    if "\x00" in value:
        return f"{key} contains a NUL byte (\\x00): no path or TOML string can hold it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a command line in another encoding arrives as surrogate escapes
        return f"{key} is not UTF-8 text (byte {e.start} of {value.encode('utf-8', 'surrogateescape')!r}): pass it in UTF-8"
    return None


def _texts(cfg: Config) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for section in dataclasses.fields(cfg):
        values: Any = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            v = getattr(values, f.name)
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                if isinstance(item, str):
                    out.append((f"{section.name}.{f.name}" + (f"[{i}]" if isinstance(v, list) else ""), item))
    return out


def text_problems(cfg: Config) -> list[str]:
    """Text fields with a NUL byte or not UTF-8. Checked first: such a path cannot even be looked at
    (`Path.exists` raises on a NUL byte), so the other checks run only when there is none."""
    return [p for key, value in _texts(cfg) if (p := _text_problem(key, value)) is not None]


def check_text_fields(cfg: Config) -> None:
    """Raise the text problems as one ConfigError (before anything reads a path from the config)."""
    from megalite.config import cli

    cli.raise_if(text_problems(cfg), "invalid config")


def field_problems(cfg: Config) -> list[str]:
    """One phrase per bad value among the ranges `validate`'s tables leave out."""
    out: list[str] = []
    lg, tr = cfg.logging, cfg.train
    if lg.sample_interval < 0:
        out.append(f"logging.sample_interval must be >= 0 (0 = never), got {lg.sample_interval}")
    if lg.sample_tokens < 1:
        out.append(f"logging.sample_tokens must be >= 1, got {lg.sample_tokens}")
    elif lg.sample_tokens > MAX_COUNT:
        out.append(f"logging.sample_tokens must be <= 2^62, got {lg.sample_tokens}")
    if tr.seed >= MAX_SEED:
        out.append(f"train.seed must be < 2^64 (an unsigned 64-bit seed), got {tr.seed}")
    for key, value in (("train.steps", tr.steps), ("train.warmup_steps", tr.warmup_steps),
                       ("train.eval_interval", tr.eval_interval), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("logging.interval", lg.interval), ("logging.sample_interval", lg.sample_interval)):
        if value > MAX_COUNT:
            out.append(f"{key} must be <= 2^62, got {value}")
    return out
