"""`model.compile true` against eager through pretrain.py, side by side, at 1 and 2 ranks (and at every layout).

Speed: for each rank count, R repeats of (eager run, compiled run), the order swapped every repeat; each run
is `pretrain.py` (torchrun for 2 ranks, dp=2) for S steps. A run's speed is the median tokens/s of its steps
after the first two (step 1 holds the compile, step 2 a recompile for the optimizer's first real step); the
ratio compiled / eager is paired per repeat, so machine-wide drift (a shared machine) cancels. Step 1's time
difference is the compile cost.

Layouts (`--layouts`): every layout at 2 ranks (tp2, tp2+sp, pp2 with 1F1B, GPipe and interleaved, dp2 ZeRO 1-3,
cp2, full recompute, document masking at dp2 and cp2, MoE at dp2 and ep2, FP8 tensorwise and rowwise) once
eager and once compiled for 3 steps: the largest loss difference (fp32; compiled kernels reorder float math,
tests/test_compile.py explains the 1e-4 bound).

    python bench/compile_compare.py                  # speed, ~10 minutes on 2 busy cores
    python bench/compile_compare.py --layouts        # every layout, ~20 minutes (--only "ep2 moe" ...: some)
    python bench/compile_compare.py --gpu --steps 6  # bench/gpu.sh's section: the GPU model, 1 rank, 1 repeat
    python bench/compile_compare.py --smoke          # seconds: aot_eager, tiny, 1 repeat
Writes runs/bench/compile_compare[_layouts|_smoke].{json,md}, or into --out DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import spread, write_results  # noqa: E402

MODEL = ["--model.num_layers", "4", "--model.hidden_size", "256", "--model.num_heads", "4", "--model.seq_len", "128"]
GPU_MODEL = ["--model.num_layers", "4", "--model.hidden_size", "1024", "--model.num_heads", "8", "--model.seq_len",
             "1024", "--train.dtype", "bf16"]  # bench/gpu.sh: big enough that a step is not launch-bound
SMOKE_MODEL = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.seq_len", "32"]
DATA = ["--data.demo_max_bytes", "300000", "--data.demo_vocab_size", "512", "--train.warmup_steps", "1",
        "--logging.interval", "1", "--train.eval_interval", "0", "--train.micro_batch_size", "8"]
MOE = ["--moe.experts", "4", "--moe.top_k", "2", "--moe.aux_loss", "0.01", "--moe.z_loss",
       "0.001"]  # every FFN routed over 4 experts, both router losses
LAYOUTS = {  # name: pretrain flags at 2 ranks
    "tp2": ["--parallel.tp", "2"], "tp2+sp": ["--parallel.tp", "2", "--parallel.sp", "true"],
    "pp2": ["--parallel.pp", "2", "--train.global_batch_size", "16"],
    "dp2 zero1": ["--parallel.zero", "1"], "dp2 zero2": ["--parallel.zero", "2"],
    "dp2 zero3": ["--parallel.zero", "3"], "cp2": ["--parallel.cp", "2"],
    "dp2 recompute full": ["--model.recompute", "full"],
    "pp2 gpipe": ["--parallel.pp", "2", "--parallel.schedule", "gpipe", "--train.global_batch_size", "16"],
    "pp2 interleaved vpp2": ["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.schedule", "interleaved",
                             "--model.num_layers", "4", "--train.global_batch_size", "16"],
    "dp2 document mask": ["--data.document_mask", "true"],
    "cp2 document mask": ["--parallel.cp", "2", "--data.document_mask", "true"],
    "dp2 moe": MOE, "ep2 moe": [*MOE, "--parallel.ep", "2"],
    "dp2 fp8 tensorwise": ["--fp8.recipe", "tensorwise", "--fp8.min_dim", "16"],
    "tp2 fp8 rowwise": ["--parallel.tp", "2", "--fp8.recipe", "rowwise", "--fp8.min_dim", "16"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pretrain(ranks: int, flags: list[str], log_dir: Path) -> list[dict]:
    """One pretrain.py run; its metrics.jsonl rows."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(_port())] if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launch, str(REPO / "pretrain.py"), *flags, "--logging.dir", str(log_dir)],
                          capture_output=True, text=True, env=env, cwd=str(REPO))
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain {flags} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def speed(ranks: int, repeats: int, steps: int, model: list[str], backend: str, cache: str) -> dict:
    ratios, eager_tps, compiled_tps, compile_s = [], [], [], []
    base = ["--data.cache_dir", cache, *DATA, *model, "--train.steps", str(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            runs: dict[str, list[dict]] = {}
            for kind in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                extra = ["--model.compile", "true", "--model.compile_backend", backend] if kind == "compiled" else []
                runs[kind] = pretrain(ranks, base + extra, Path(tmp) / f"{ranks}-{r}-{kind}")
            tps = {k: statistics.median(row["tokens_per_s"] for row in rows[2:]) for k, rows in runs.items()}
            eager_tps.append(tps["eager"])
            compiled_tps.append(tps["compiled"])
            ratios.append(tps["compiled"] / tps["eager"])
            compile_s.append(runs["compiled"][0]["step_time_s"] - runs["eager"][0]["step_time_s"])
    return {"ranks": ranks, "eager_tokens_per_s": spread(eager_tps), "compiled_tokens_per_s": spread(compiled_tps),
            "compiled_over_eager": spread(ratios), "compile_s": spread(compile_s), "repeats": repeats}


def layouts(steps: int, model: list[str], backend: str, cache: str, only: list[str] | None = None) -> list[dict]:
    out = []
    base = ["--data.cache_dir", cache, *DATA, *model, "--train.steps", str(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in LAYOUTS.items():
            if only and name not in only:
                continue
            eager = pretrain(2, base + flags, Path(tmp) / f"{name}-eager")
            compiled = pretrain(2, base + flags + ["--model.compile", "true", "--model.compile_backend", backend],
                                Path(tmp) / f"{name}-compiled")
            diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(eager, compiled))
            out.append({"layout": name, "steps": len(compiled), "max_loss_diff": diff,
                        "eager_loss": [a["loss"] for a in eager], "compiled_loss": [b["loss"] for b in compiled]})
            print(f"{name}: max |compiled - eager| loss {diff:.2e}", flush=True)
    return out


def to_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"torch.compile ({m['backend']}) vs eager through pretrain.py, {m['date']}, {m['machine']}, "
             f"load average {m['load_before']} before / {m['load_after']} after", ""]
    if res.get("speed"):
        lines += ["| ranks | eager tokens/s | compiled tokens/s | compiled / eager (paired, min-median-max) | "
                  "compile s (step 1) |", "|---|---|---|---|---|"]
        for s in res["speed"]:
            c = s["compiled_over_eager"]
            lines.append(f"| {s['ranks']} | {s['eager_tokens_per_s']['median']:.0f} | "
                         f"{s['compiled_tokens_per_s']['median']:.0f} | {c['min']:.2f} / **{c['median']:.2f}** / "
                         f"{c['max']:.2f} | {s['compile_s']['median']:.0f} |")
    if res.get("layouts"):
        lines += ["", "| layout (2 ranks) | steps | max abs loss difference |", "|---|---|---|"]
        lines += [f"| {r['layout']} | {r['steps']} | {r['max_loss_diff']:.1e} |" for r in res["layouts"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layouts", action="store_true", help="every layout at 2 ranks instead of the speed runs")
    ap.add_argument("--only", nargs="+", choices=list(LAYOUTS), metavar="LAYOUT",
                    help=f"with --layouts: only these (of: {', '.join(LAYOUTS)})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--gpu", action="store_true", help="bench/gpu.sh: the GPU model, 1 rank, 1 repeat")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    a = ap.parse_args(argv)
    model, backend = (SMOKE_MODEL, "aot_eager") if a.smoke else (GPU_MODEL if a.gpu else MODEL, a.backend)
    if a.gpu:
        a.ranks, a.repeats = [1], 1
    repeats, steps = (1, 4) if a.smoke else (a.repeats, a.steps)
    cache = str(a.out / "cache")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "backend": backend, "smoke": a.smoke,
            "load_before": round(os.getloadavg()[0], 1)}
    res: dict = {"meta": meta}
    if a.layouts:
        res["layouts"] = layouts(3, SMOKE_MODEL, backend, cache, a.only)  # correctness: the small model is enough
    else:
        res["speed"] = [speed(n, repeats, steps, model, backend, cache) for n in ([1] if a.smoke else a.ranks)]
    meta["load_after"] = round(os.getloadavg()[0], 1)
    stem = "compile_compare" + ("_layouts" if a.layouts else "") + ("_gpu" if a.gpu else "") + ("_smoke" if a.smoke else "")
    write_results(a.out, stem, res, to_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
