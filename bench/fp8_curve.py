"""FP8 against BF16 on the demo: the loss curves of fp8.recipe = none | tensorwise | rowwise, same seed and data
(`--variants none blockwise mxfp8`: the block recipes instead, written as fp8_curve_blocks*).

Each variant is a `pretrain.py` run (bf16 run dtype, logging every step, no evaluation), all three started
together and sharing the machine, so a loaded machine slows them alike and a stopped benchmark leaves
them at about the same step. The figure is the loss gap per step (fp8 - bf16), as the final gap (mean over
the last `--tail` steps, which averages out single-batch noise), the max |gap| over all steps, the relative
gap, and whether any loss or gradient norm was NaN/inf.

    python bench/fp8_curve.py --steps 300            # the demo; ~minutes per 10 steps on a loaded 2-core box
    python bench/fp8_curve.py --smoke                # seconds: 3 steps
    python bench/fp8_curve.py --preset tiny-moe --steps 300 --micro-batch 2   # FP8 expert GEMMs too
    python bench/fp8_curve.py --steps 300 --variants none blockwise mxfp8   # DeepSeek-V3's and MX's recipes
Writes runs/bench/fp8_curve.{json,md} (fp8_curve_PRESET.* for another preset than the demo's), or into
--out DIR (--out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch import start_pretrain  # noqa: E402
from bench.results_io import write_results  # noqa: E402
from megalite.fp8.costs import FP8_CHOICES  # noqa: E402

VARIANTS = ("none", "tensorwise", "rowwise")


def launch(variant: str, args: argparse.Namespace, run_dir: Path) -> subprocess.Popen:
    argv = ["--model.preset", args.preset, "--train.steps", str(args.steps),
            "--train.dtype", "bf16", "--fp8.recipe", variant, "--fp8.min_dim", str(args.min_dim),
            "--train.eval_interval", "0", "--logging.interval", "1", "--logging.dir", str(run_dir),
            "--train.memory_check", "false"]
    if args.micro_batch:
        argv += ["--train.micro_batch_size", str(args.micro_batch)]
    if args.smoke:
        argv += ["--data.demo_max_bytes", "20000"]
    return start_pretrain(argv, run_dir, args.threads)


def read_curve(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "step" in r]


def compare(base: list[dict[str, Any]], other: list[dict[str, Any]], tail: int) -> dict[str, Any]:
    """The gap of `other`'s losses to `base`'s over the steps both reached."""
    b = {r["step"]: r for r in base}
    steps = [r["step"] for r in other if r["step"] in b]
    gaps = [next(r for r in other if r["step"] == s)["loss"] - b[s]["loss"] for s in steps]
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r.get("grad_norm") or 0.0) for r in other)
    if not steps:
        return {"steps": 0, "finite": finite}
    last = gaps[-tail:]
    base_tail = [b[s]["loss"] for s in steps[-tail:]]
    return {"steps": steps[-1], "finite": finite, "final_gap": sum(last) / len(last),
            "final_rel_gap": sum(last) / sum(base_tail), "max_abs_gap": max(abs(g) for g in gaps),
            "final_loss_base": base_tail[-1], "final_loss": b[steps[-1]]["loss"] + gaps[-1],
            "skipped_steps": sum(bool(r.get("skipped")) for r in other)}


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"FP8 vs BF16 loss curve: preset {m['preset']}, {m['date']}, {m['machine']}, load average "
             f"{m['load_start']} at start / {m['load_end']} at end{' (SMOKE)' if m['smoke'] else ''}", "",
             "| variant | steps | final loss | bf16 final loss | final gap (mean last {0}) | relative | max abs gap | "
             "no NaN |".format(m["tail"]), "|---|---|---|---|---|---|---|---|"]
    for v, c in res["gaps"].items():
        if not c["steps"]:
            lines.append(f"| {v} | 0 | | | | | | {c['finite']} |")
            continue
        lines.append(f"| {v} | {c['steps']} | {c['final_loss']:.4f} | {c['final_loss_base']:.4f} | "
                     f"{c['final_gap']:+.4f} | {100 * c['final_rel_gap']:+.2f}% | {c['max_abs_gap']:.4f} | "
                     f"{c['finite']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: the preset's / demo's default")
    ap.add_argument("--min-dim", type=int, default=128, help="fp8.min_dim")
    ap.add_argument("--tail", type=int, default=20, help="steps the final gap is averaged over")
    ap.add_argument("--threads", type=int, default=1, help="threads per run (three runs at once)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=FP8_CHOICES,
                    help="fp8.recipe values to run together; the first is the baseline the others are compared to")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.tail = 3, 2
    out = Path(os.environ.get("OUT", args.out)) if args.smoke and "OUT" in os.environ else Path(args.out)
    work = out / f"fp8_curve_runs_{args.preset}"
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    variants = tuple(args.variants)
    procs = {v: launch(v, args, work / v) for v in variants}
    codes = {v: p.wait() for v, p in procs.items()}
    curves = {v: read_curve(work / v) for v in variants}
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                    "machine": f"{platform.machine()} {os.cpu_count()} cores", "preset": args.preset,
                    "load_start": round(load_start, 1), "load_end": round(os.getloadavg()[0], 1),
                    "smoke": args.smoke, "tail": args.tail, "exit_codes": codes},
           "gaps": {v: compare(curves[variants[0]], curves[v], args.tail) for v in variants[1:]},
           "curves": {v: [(r["step"], r["loss"]) for r in c] for v, c in curves.items()}}
    name = "fp8_curve" if args.preset == "tiny" else f"fp8_curve_{args.preset}"  # the demo's keeps its name
    name += "" if variants == VARIANTS else "_blocks" if set(variants) == {"none", "blockwise", "mxfp8"} else \
        "_" + "_".join(variants)
    write_results(out, f"{name}_smoke" if args.smoke else name, res, to_markdown)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
