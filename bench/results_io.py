"""Where every benchmark writes its figures: `<out>/<stem>.json` (the raw results) and `<out>/<stem>.md` (the
table the docs quote), the markdown also printed. `--out bench/results` updates the published figures; the
default `runs/bench` keeps a local run from overwriting them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable


def write_results(out: Path, stem: str, res: dict[str, Any], to_markdown: Callable[[dict[str, Any]], str]) -> str:
    """Write `res` as JSON and its markdown table under `out`, print the table, and return it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = to_markdown(res)
    (out / f"{stem}.md").write_text(md)
    print(md, flush=True)
    return md


def spread(xs: list[float]) -> dict[str, float]:
    """min / median / max of repeated measurements (the medians the docs quote, the spread beside them)."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
