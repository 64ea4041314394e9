"""Reading JSON and TOML that megalite did not write itself (index.json, an HF config.json, metrics lines,
`--config`, tokenizer files) with a bound on nesting.

A file nested a few thousand levels deep is valid JSON/TOML but ends the parser (and any later walk over
the result, e.g. `json.dumps` when a config is saved) in a RecursionError traceback. Every such read goes
through `loads_json` / `load_json_file` / `loads_toml`: the parser's RecursionError and a result deeper than
`MAX_DEPTH` become one line naming the file, as the caller's error class (CheckpointError, DataError ...).
Nothing megalite reads legitimately is deeper than a handful of levels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from megalite.errors import MegaliteError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject pulls tomli for 3.10
    import tomli as tomllib

MAX_DEPTH = 64


def depth(value: Any) -> int:
    """Nesting depth of lists/dicts in `value` (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            level += 1
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level  # deep enough to refuse: no need to walk the rest
            stack.extend((v, level) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_deep(what: str, error: type[MegaliteError]) -> MegaliteError:
    return error(f"{what} is nested more than {MAX_DEPTH} levels deep: not a file megalite or its tools "
                 "write; it was edited or comes from elsewhere")


def bounded(value: Any, what: str, error: type[MegaliteError]) -> Any:
    """`value` if it is at most MAX_DEPTH deep, else `error`."""
    if depth(value) > MAX_DEPTH:
        raise _too_deep(what, error)
    return value


def loads_json(text: str | bytes, what: str, error: type[MegaliteError]) -> Any:
    """json.loads with the depth bound; json.JSONDecodeError (a ValueError) is left to the caller."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(what, error) from None
    return bounded(value, what, error)


def load_json_file(path: str | Path, what: str, error: type[MegaliteError]) -> Any:
    """A JSON file, read as UTF-8, depth-bounded; unreadable, non-UTF-8 or invalid JSON is `error` too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise error(f"cannot read {what} ({e.strerror or e})") from None
    try:
        return loads_json(text, what, error)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def loads_toml(text: str, what: str, error: type[MegaliteError]) -> dict[str, Any]:
    """tomllib.loads with the depth bound; tomllib.TOMLDecodeError is left to the caller."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise _too_deep(what, error) from None
    return bounded(value, what, error)  # type: ignore[no-any-return]
