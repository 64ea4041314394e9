"""Plot one or several runs' metrics.jsonl on shared axes: training and validation loss, learning
rate, gradient norm, tokens/s, peak memory, and the communication bytes per step of each process group.

    python tools/plot_metrics.py runs/latest                      # -> runs/latest/metrics.png
    python tools/plot_metrics.py runs/tp2/metrics.jsonl runs/zero3 -o compare.png --labels tp2 zero3

A run directory stands for every run logged there: its metrics.jsonl and the earlier runs' files that
a fresh run moved aside (metrics.1.jsonl, metrics.2.jsonl, ...). One line per run: a file that holds
several runs (written before megalite rotated them) is split where the step number goes back.
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.checkpoint.files import atomic_output  # noqa: E402
from megalite.errors import ConfigError, DataError, MegaliteError, entry_point, report  # noqa: E402
from megalite.untrusted import loads_json  # noqa: E402

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
            rec = loads_json(line, f"{p}:{lineno}", DataError)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{lineno} is not JSON ({exc.msg}); was the run killed mid-write? "
                            f"delete that line") from exc
        if isinstance(rec, dict) and "step" in rec:
            records.append(_checked_record(rec, f"{p}:{lineno}"))
    if not records:
        raise DataError(f"{p} holds no step records; let the run log at least one step")
    return records


NUMBER_FIELDS = ("loss", "valid_loss", "lr", "grad_norm", "tokens_per_s", "mem_peak_bytes")
FORMATS = ("png", "pdf", "svg")  # what matplotlib's Agg backend writes


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checked_record(rec: dict, where: str) -> dict:
    """A step record whose plotted fields have the types megalite writes (a number or null; comm_bytes an
    object of numbers), or DataError naming the line and field: a record is not trusted to be well formed."""
    step = rec["step"]
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise DataError(f"{where}: step is {step!r}, not a whole number >= 0: the file was edited or is not a "
                        "megalite metrics.jsonl")
    for key in NUMBER_FIELDS:
        if rec.get(key) is not None and not _is_number(rec[key]):
            raise DataError(f"{where}: {key} is {type(rec[key]).__name__} {rec[key]!r}, not a number or null")
    comm = rec.get("comm_bytes")
    if comm is not None and not (isinstance(comm, dict) and all(isinstance(k, str) and (v is None or _is_number(v))
                                                                for k, v in comm.items())):
        raise DataError(f"{where}: comm_bytes is {type(comm).__name__}, not an object of group -> bytes")
    return rec


def output_path(out: str | Path) -> Path:
    """The plot's path; its suffix picks the format, one of FORMATS (ConfigError otherwise)."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise ConfigError(f"-o {out}: the suffix picks the format; use .{', .'.join(FORMATS)}")
    return out


def split_runs(records: Records) -> list[Records]:
    """Consecutive records with rising steps are one run; a step that goes back starts the next."""
    runs: list[Records] = [[]]
    for rec in records:
        if runs[-1] and rec["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(rec)
    return runs


def run_files(path: str | Path) -> list[Path]:
    """A metrics.jsonl; for a directory, its rotated files oldest first, then metrics.jsonl."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    rotated = [f for f in p.glob("metrics.*.jsonl") if f.name.split(".")[1].isdigit()]
    files = sorted(rotated, key=lambda f: int(f.name.split(".")[1]))
    return files + [p / "metrics.jsonl"] if (p / "metrics.jsonl").exists() or not files else files


def load_runs(path: str | Path, label: str) -> dict[str, Records]:
    """label -> records for every run found at `path` ("label", or "label #1", "label #2" ...)."""
    found = [run for f in run_files(path) for run in split_runs(load_metrics(f))]
    if len(found) == 1:
        return {label: found[0]}
    return {f"{label} #{i}": run for i, run in enumerate(found, 1)}


def _series(records: Records, key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def comm_note(runs: dict[str, Records]) -> str | None:
    """What the communication panel says when it has nothing to draw: a one-process run moves no bytes
    between ranks (its metrics hold no group, or only zeros)."""
    values = [v for recs in runs.values() for r in recs for v in (r.get("comm_bytes") or {}).values()
              if isinstance(v, (int, float))]
    if any(values):
        return None
    return ("no communication: every run here is one process (no bytes between ranks)" if not values
            else "no communication: every group moved 0 bytes (one process, or dp/tp/pp/cp all 1)")


def plot_runs(runs: dict[str, Records], out: str | Path) -> Path:
    """Write a 3x2 PNG comparing `runs` (label -> records); returns the path written."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MegaliteError("plotting needs matplotlib: `pip install matplotlib` "
                            "(or `pip install -e .[dev]`)") from exc
    matplotlib.use("Agg")  # files only: no display needed on a cluster login node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 11), sharex=True)
    panels = ((axes[0][0], "loss", "loss (dashed: validation)"), (axes[0][1], "lr", "learning rate"),
              (axes[1][0], "grad_norm", "gradient norm (before clipping)"),
              (axes[1][1], "tokens_per_s", "tokens / s (whole job)"))
    for ax, key, title in panels:
        for label, recs in runs.items():
            xs, ys = _series(recs, key)
            if xs:
                line = ax.plot(xs, ys, label=label)[0]
                if key == "loss":
                    vx, vy = _series(recs, "valid_loss")
                    if vx:
                        ax.plot(vx, vy, "--o", color=line.get_color(), markersize=3, label=f"{label}: valid")
        ax.set_title(title)
    ax = axes[2][0]
    for label, recs in runs.items():
        xs, ys = _series(recs, "mem_peak_bytes")
        if xs:
            ax.plot(xs, [y / 2**30 for y in ys], label=label)
    ax.set_title("peak memory (GiB, rank 0's process or device)")
    ax = axes[2][1]
    for label, recs in runs.items():
        groups = sorted({g for r in recs for g in (r.get("comm_bytes") or {})})
        for g in groups:
            pts = [(r["step"], r["comm_bytes"][g] / 1e9) for r in recs
                   if isinstance((r.get("comm_bytes") or {}).get(g), (int, float))]
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"{label}: {g}")
    ax.set_title("communication per step per rank (GB, wire bytes)")
    notes = {id(axes[2][1]): comm_note(runs)}
    for row in axes:
        for a in row:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
            note = notes.get(id(a)) or (None if a.lines else "no data: metrics.jsonl has no values for this panel")
            if note:  # an empty box would read as a plotting failure
                a.text(0.5, 0.5, note, ha="center", va="center", transform=a.transAxes, fontsize=9, wrap=True)
    fig.tight_layout()
    out = output_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out) as tmp:  # an existing PNG is replaced only by a complete one
        fig.savefig(tmp, dpi=100, format=out.suffix.lstrip(".").lower())
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files or run directories")
    ap.add_argument("-o", "--output", help="plot to write, .png, .pdf or .svg (default: metrics.png in the first run's folder)")
    ap.add_argument("--labels", nargs="+", help="one legend label per run (default: the run's folder)")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        print(f"error: {len(args.labels)} labels for {len(args.metrics)} runs; give one per run",
              file=sys.stderr)
        return 2
    try:
        if args.output:
            output_path(args.output)  # refused before any file is read
        runs: dict[str, Records] = {}
        for i, path in enumerate(args.metrics):
            p = Path(path)
            label = args.labels[i] if args.labels else (p if p.is_dir() else p.parent).resolve().name
            while any(k == label or k.startswith(label + " #") for k in runs):
                label += "'"
            runs.update(load_runs(p, label))
        first = Path(args.metrics[0])
        out = plot_runs(runs, args.output or (first if first.is_dir() else first.parent) / "metrics.png")
    except MegaliteError as exc:
        return report(exc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main)())
