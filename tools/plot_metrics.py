"""Plot one or several runs' metrics.jsonl on shared axes: loss, learning rate, tokens/s, and the
communication bytes per step of each process group.

    python tools/plot_metrics.py runs/tp2/metrics.jsonl runs/zero3 -o compare.png --labels tp2 zero3

A run directory stands for its metrics.jsonl. Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.checkpoint.files import atomic_output  # noqa: E402
from megalite.errors import DataError, MegaliteError, entry_point, report  # noqa: E402

Records = list[dict]


def load_metrics(path: str | Path) -> Records:
    """The JSON objects of a metrics.jsonl (or of `<dir>/metrics.jsonl`), in file order."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise DataError(f"{p} does not exist; pass a metrics.jsonl or the run's logging.dir")
    records: Records = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{lineno} is not JSON ({exc.msg}); was the run killed mid-write? "
                            f"delete that line") from exc
        if isinstance(rec, dict) and "step" in rec:
            records.append(rec)
    if not records:
        raise DataError(f"{p} holds no step records; let the run log at least one step")
    return records


def _series(records: Records, key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_runs(runs: dict[str, Records], out: str | Path) -> Path:
    """Write a 2x2 PNG comparing `runs` (label -> records); returns the path written."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MegaliteError("plotting needs matplotlib: `pip install matplotlib` "
                            "(or `pip install -e .[dev]`)") from exc
    matplotlib.use("Agg")  # files only: no display needed on a cluster login node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    panels = ((axes[0][0], "loss", "loss"), (axes[0][1], "lr", "learning rate"),
              (axes[1][0], "tokens_per_s", "tokens / s"))
    for ax, key, title in panels:
        for label, recs in runs.items():
            xs, ys = _series(recs, key)
            if xs:
                ax.plot(xs, ys, label=label)
        ax.set_title(title)
    ax = axes[1][1]
    for label, recs in runs.items():
        groups = sorted({g for r in recs for g in (r.get("comm_bytes") or {})})
        for g in groups:
            pts = [(r["step"], r["comm_bytes"][g] / 1e9) for r in recs
                   if isinstance((r.get("comm_bytes") or {}).get(g), (int, float))]
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"{label}: {g}")
    ax.set_title("communication per step per rank (GB, wire bytes)")
    for row in axes:
        for a in row:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out) as tmp:  # an existing PNG is replaced only by a complete one
        fig.savefig(tmp, dpi=100, format=out.suffix.lstrip(".") or "png")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files or run directories")
    ap.add_argument("-o", "--output", default="metrics.png", help="PNG to write")
    ap.add_argument("--labels", nargs="+", help="one legend label per run (default: the run's folder)")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        print(f"error: {len(args.labels)} labels for {len(args.metrics)} runs; give one per run",
              file=sys.stderr)
        return 2
    try:
        runs: dict[str, Records] = {}
        for i, path in enumerate(args.metrics):
            p = Path(path)
            label = args.labels[i] if args.labels else (p if p.is_dir() else p.parent).resolve().name
            while label in runs:
                label += "'"
            runs[label] = load_metrics(p)
        out = plot_runs(runs, args.output)
    except MegaliteError as exc:
        return report(exc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main)())
