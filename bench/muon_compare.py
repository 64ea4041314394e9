"""Muon against AdamW: the loss after the same tokens and the step-time overhead, same seed and data.

For each workload, two `pretrain.py` runs (optimizer.name = adamw | muon; everything else, learning rate
and weight decay included, the same: Liu et al.'s RMS matching is what lets Muon reuse AdamW's) started
together, one thread each, so a loaded machine slows both alike. Figures: the training loss averaged over
the last `--tail` logged steps, the final validation loss, and the step-time overhead as the ratio of the
median `step_time_s` of muon over adamw, each over the steps it took while the other run was still going
(side by side on the same cores).

    python bench/muon_compare.py                      # demo (tiny, 300 steps) and wide (h=192, 6 layers, 120)
    python bench/muon_compare.py --smoke              # seconds: 3 steps of the demo
Writes runs/bench/muon_compare.{json,md}, or into --out DIR (--out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch import start_pretrain  # noqa: E402
from bench.results_io import write_results  # noqa: E402

# name -> (steps, extra pretrain.py flags). "wide" is the tiny preset at 1.5x width and layers (3.2M parameters):
# megalite's next preset (llama-160m) takes minutes per 10 steps on a shared 2-core CPU.
WORKLOADS: dict[str, tuple[int, list[str]]] = {
    "demo": (300, []),
    "wide": (120, ["--model.hidden_size", "192", "--model.num_layers", "6", "--model.num_heads", "6",
                   "--model.num_kv_heads", "3"]),
}
OPTIMIZERS = ("adamw", "muon")


def launch(opt: str, steps: int, extra: list[str], run_dir: Path, smoke: bool) -> subprocess.Popen:
    argv = ["--optimizer.name", opt, "--train.steps", str(steps), "--train.eval_interval", str(steps),
            "--logging.interval", "1", "--logging.dir", str(run_dir), "--train.memory_check", "false", *extra]
    return start_pretrain(argv + (["--data.demo_max_bytes", "20000"] if smoke else []), run_dir, 1)


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(rows: dict[str, list[dict[str, Any]]], tail: int) -> dict[str, Any]:
    train = {o: {r["step"]: r for r in rows[o] if "loss" in r and "step" in r} for o in OPTIMIZERS}
    valid = {o: [r["valid_loss"] for r in rows[o] if r.get("valid_loss") is not None] for o in OPTIMIZERS}
    steps = sorted(set(train["adamw"]) & set(train["muon"]))
    out: dict[str, Any] = {"steps": steps[-1] if steps else 0}
    if not steps:
        return out
    for o in OPTIMIZERS:
        out[f"{o}_tail_loss"] = statistics.mean(train[o][s]["loss"] for s in steps[-tail:])
        out[f"{o}_valid_loss"] = valid[o][-1] if valid[o] else None
    # Side by side: only the steps each run took while the other was still running (the first step, which
    # builds the model and warms up, left out), so both shared the machine alike.
    both_until = min(max(r["timestamp"] for r in train[o].values()) for o in OPTIMIZERS)
    times = {o: [r["step_time_s"] for s, r in sorted(train[o].items())[1:] if r["timestamp"] <= both_until]
             for o in OPTIMIZERS}
    if all(times.values()):
        out["step_time_ratio_median"] = statistics.median(times["muon"]) / statistics.median(times["adamw"])
        out["adamw_step_s_median"] = statistics.median(times["adamw"])
        out["paired_steps"] = {o: len(t) for o, t in times.items()}
    return out


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"Muon vs AdamW: {m['date']}, {m['machine']}, load average {m['load_start']} at start / "
             f"{m['load_end']} at end{' (SMOKE)' if m['smoke'] else ''}", "",
             f"| workload | steps | AdamW loss (last {m['tail']}) | Muon loss | AdamW valid | Muon valid | "
             "Muon/AdamW step time (medians, side by side) | AdamW step (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in res["workloads"].items():
        if not s["steps"]:
            lines.append(f"| {name} | 0 | | | | | | |")
            continue

        def f(x: float | None, fmt: str = ".4f") -> str:
            return "" if x is None else format(x, fmt)
        lines.append(f"| {name} | {s['steps']} | {f(s['adamw_tail_loss'])} | {f(s['muon_tail_loss'])} | "
                     f"{f(s['adamw_valid_loss'])} | {f(s['muon_valid_loss'])} | "
                     f"{f(s.get('step_time_ratio_median'), '.3f')} | {f(s.get('adamw_step_s_median'), '.3f')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--tail", type=int, default=20, help="steps the final training loss is averaged over")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    names = ["demo"] if args.smoke else args.workloads.split(",")
    if args.smoke:
        args.tail = 2
    out = Path(args.out)
    work = out / "muon_compare_runs"
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    res: dict[str, Any] = {"workloads": {}, "codes": {}}
    for name in names:
        steps, extra = WORKLOADS[name]
        steps = 3 if args.smoke else steps
        procs = {o: launch(o, steps, extra, work / f"{name}-{o}", args.smoke) for o in OPTIMIZERS}
        res["codes"][name] = {o: p.wait() for o, p in procs.items()}
        res["workloads"][name] = summarise({o: read_rows(work / f"{name}-{o}") for o in OPTIMIZERS},
                                           min(args.tail, steps))
    res["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                   "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_start": round(load_start, 1),
                   "load_end": round(os.getloadavg()[0], 1), "smoke": args.smoke, "tail": args.tail}
    write_results(out, "muon_compare_smoke" if args.smoke else "muon_compare", res, to_markdown)
    return 0 if all(c == 0 for codes in res["codes"].values() for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
