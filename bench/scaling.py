"""The same small model at several parallel layouts on CPU/gloo: measured vs predicted.

Each layout is one `torchrun` launch of `pretrain.py`'s entry point (through `--worker` below, which
also records every rank's peak RSS) for a few steps on the demo corpus. From `metrics.jsonl` we take
the median step time (first step dropped: it pays for lazy init), the comm bytes per process group
of the last step (the counter is reset every step), and rank 0's peak memory; beside them the
estimator's predicted bytes (`megalite.perfmodel.estimate.estimate`, fp32 precision).

A layout whose run fails is reported as skipped with its error. Wall-clock on gloo/CPU measures Python + gloo over loopback, not NVLink: use the
step times to compare layouts on this machine only; the byte counts are exact anywhere.

    python bench/scaling.py            # a few minutes on 2 cores
    python bench/scaling.py --smoke    # tp=2 sp only, 2 steps: well under a minute
Writes runs/bench/scaling.{json,md,png}, or into --out DIR (--out bench/results updates the
published figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.launch import run_script_ranks  # noqa: E402
from megalite.observability.metrics import peak_rss_bytes  # noqa: E402
from bench.results_io import write_results  # noqa: E402

from megalite.perfmodel.estimate import Layout, ModelDims, Precision, estimate  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    flags: tuple[str, ...]

    def layout(self, mbs: int) -> Layout:
        f = dict(zip(self.flags[::2], self.flags[1::2]))
        tp, pp = int(f.get("--parallel.tp", 1)), int(f.get("--parallel.pp", 1))
        gbs = int(f.get("--train.global_batch_size", 0)) or None
        return Layout(tp=tp, pp=pp, dp=self.nproc // (tp * pp), zero=int(f.get("--parallel.zero", 0)),
                      sp=f.get("--parallel.sp", "false") == "true", micro_batch_size=mbs, global_batch_size=gbs)


CASES = [
    Case("single", 1, ()),
    Case("dp=2", 2, ()),
    Case("tp=2", 2, ("--parallel.tp", "2")),
    Case("tp=2 sp", 2, ("--parallel.tp", "2", "--parallel.sp", "true")),
    Case("pp=2 1f1b m=4", 2, ("--parallel.pp", "2", "--train.global_batch_size", "16")),
    Case("dp=2 zero=1", 2, ("--parallel.zero", "1")),
]
SMOKE_CASES = ["tp=2 sp"]  # the one-process launch is cp_memory.py --smoke's cp = 1 run


def worker(argv: list[str]) -> int:
    """One rank under torchrun: train via the trainer, then record this rank's peak RSS."""
    from megalite.training.trainer import main

    code = main(argv)
    log_dir = argv[argv.index("--logging.dir") + 1]
    rank = os.environ.get("RANK", "0")
    rss = peak_rss_bytes()  # VmHWM (ru_maxrss would carry the launcher's RSS over the fork)
    Path(log_dir, f"rss_rank{rank}.json").write_text(json.dumps({"rank": int(rank), "peak_rss_bytes": rss}))
    return code


def run_case(case: Case, common: list[str], run_dir: Path) -> dict:
    log_dir = run_dir / case.name.replace(" ", "_").replace("=", "")
    argv = [*common, *case.flags, "--logging.dir", str(log_dir)]
    # One thread per rank: 2 ranks fill the 2 cores.
    proc = run_script_ranks(Path(__file__).resolve(), case.nproc, argv, threads=1, timeout_s=600)
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines() or ["?"]
        return {"name": case.name, "skipped": f"run failed: {err[-1].strip()[:200]}"}
    rows = [json.loads(ln) for ln in (log_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
    rss = sorted((json.loads(p.read_text()) for p in log_dir.glob("rss_rank*.json")), key=lambda d: d["rank"])
    model = tomllib.loads((log_dir / "config.toml").read_text())["model"]
    return {"name": case.name, "nproc": case.nproc, "flags": list(case.flags),
            "step_time_s_median": statistics.median(times), "step_time_s_min": min(times), "step_time_s_all": times,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows[1:] or rows),
            "comm_bytes": rows[-1]["comm_bytes"], "mem_peak_bytes_rank0": rows[-1]["mem_peak_bytes"],
            "peak_rss_bytes_per_rank": [d["peak_rss_bytes"] for d in rss], "model": model,
            "final_loss": rows[-1]["loss"]}


def predict(case: Case, model: dict, mbs: int) -> dict[str, float]:
    dims = ModelDims(num_layers=model["num_layers"], hidden_size=model["hidden_size"], num_heads=model["num_heads"],
                     vocab_size=model["vocab_size"], seq_len=model["seq_len"], arch=model["arch"],
                     num_kv_heads=model["num_kv_heads"], ffn_hidden_size=model["ffn_hidden_size"],
                     tie_embeddings=model["tie_embeddings"],
                     make_vocab_divisible_by=model["make_vocab_divisible_by"])
    return {g: b for g, b in estimate(dims, case.layout(mbs), Precision.for_dtype("fp32")).comm_bytes.items()
            if b > 0}


def to_markdown(res: dict) -> str:
    lines = [f"CPU/gloo scaling, {res['model_desc']}; {res['steps']} steps per layout, median step time over steps "
             f"2..{res['steps']}; 1 thread per rank; {res['date']}, {res['cpu_count']} cores.", "",
             "| layout | ranks | step time s median (min) | tokens/s | comm bytes/step measured | predicted "
             "| peak RSS per rank MiB |", "|---|---|---|---|---|---|---|"]
    fmt = lambda d: ", ".join(f"{g} {b / 1e6:.3f} MB" for g, b in sorted(d.items())) or "none"  # noqa: E731
    for r in res["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | - | skipped: {r['skipped']} | | | | |")
            continue
        measured = {g: b for g, b in r["comm_bytes"].items() if g in ("tp", "dp", "pp", "embedding")}
        other = {g: b for g, b in r["comm_bytes"].items() if g not in measured}
        extra = f" (+ {fmt(other)} scalars)" if other else ""
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes_per_rank"])
        lines.append(f"| {r['name']} | {r['nproc']} | {r['step_time_s_median']:.3f} ({r['step_time_s_min']:.3f}) "
                     f"| {r['tokens_per_s_median']:.0f} "
                     f"| {fmt(measured)}{extra} | {fmt(r['predicted_comm_bytes'])} | {rss} |")
    lines.append("\nMB = 1e6 wire bytes per rank per step (ring convention, megalite.parallel.counter). "
                 "'mp', 'norm' and 'metrics' carry the grad-norm and loss scalars (a few bytes), "
                 "which the estimator leaves out.")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no PNG (pip install matplotlib)"
    runs = [r for r in res["runs"] if "skipped" not in r]
    names = [r["name"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [r["tokens_per_s_median"] for r in runs], color="tab:blue")
    ax1.set_ylabel("tokens/s, all ranks (median step)")
    ax1.set_title("throughput on 2 CPU cores / gloo")
    groups = sorted({g for r in runs for g in (*r["predicted_comm_bytes"], *r["comm_bytes"])
                     if g in ("tp", "dp", "pp", "embedding")})
    width = 0.8 / max(1, 2 * len(groups))
    for j, g in enumerate(groups):
        xs = [i + (2 * j) * width - 0.4 + width / 2 for i in range(len(runs))]
        ax2.bar(xs, [r["comm_bytes"].get(g, 0) / 1e6 for r in runs], width, label=f"{g} measured")
        ax2.bar([x + width for x in xs], [r["predicted_comm_bytes"].get(g, 0) / 1e6 for r in runs], width,
                label=f"{g} predicted", hatch="//", alpha=0.6)
    ax2.set_xticks(range(len(runs)), names)
    ax2.set_ylabel("MB per rank per step")
    ax2.set_title("communication: measured vs estimator")
    ax2.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        return worker(args[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="tp=2 sp only, 2 steps, tiny model")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                  help="output directory (default runs/bench, untracked; bench/results: the published figures)")
    a = p.parse_args(args)
    if a.smoke:
        a.steps, a.layers, a.hidden, a.seq, a.micro_batch = 2, 2, 32, 32, 2
    from megalite.data import prepare_demo_data

    with tempfile.TemporaryDirectory(prefix="megalite-scaling-") as tmp:
        cache = os.environ.get("MEGALITE_CACHE") or str(Path(tmp) / "cache")
        prepare_demo_data(cache, 300_000, 512)  # once, before any rank races to build it
        common = ["--data.cache_dir", cache, "--data.demo_max_bytes", "300000", "--data.demo_vocab_size", "512",
                  "--model.num_layers", str(a.layers), "--model.hidden_size", str(a.hidden), "--model.num_heads", "4",
                  "--model.num_kv_heads", "2", "--model.seq_len", str(a.seq), "--train.micro_batch_size",
                  str(a.micro_batch), "--train.steps", str(a.steps), "--train.warmup_steps", "1",
                  "--logging.interval", "1", "--train.eval_interval", "0", "--model.kernels", "torch"]
        runs = []
        for case in (c for c in CASES if not a.smoke or c.name in SMOKE_CASES):
            r = run_case(case, common, Path(tmp))
            if "skipped" not in r:
                r["predicted_comm_bytes"] = predict(case, r.pop("model"), a.micro_batch)
            print(json.dumps({k: v for k, v in r.items() if k != "step_time_s_all"}), flush=True)
            runs.append(r)
    res = {"date": datetime.date.today().isoformat(), "cpu_count": os.cpu_count(), "steps": a.steps,
           "model_desc": f"llama {a.layers} layers, hidden {a.hidden}, 4 heads (2 kv), seq {a.seq}, "
                         f"micro-batch {a.micro_batch}/rank, demo vocab 512, fp32", "runs": runs}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "scaling_smoke" if a.smoke else "scaling"
    note = plot(res, a.out / f"{stem}.png")
    if note:
        res["notes"] = [note]
    write_results(a.out, stem, res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
