"""How close to this machine's limit: each implementation's training-step FLOP/s as a fraction of the machine's own
dense matmul throughput, for 3 model sizes.

The limit: fp32 `torch.mm` of square matrices (n = 1024 and 2048, best of 5 each) with every thread, the
physical ceiling for a workload that is nearly all GEMMs. The implementations (bench/cpu_compare.py's, same
dims, batch, fp32, fused AdamW, clip 1.0): megalite eager, megalite with `model.compile` (inductor), transformers'
LlamaForCausalLM, a minimal plain-torch loop. Every one is credited with the SAME FLOPs per step, megalite's count
(`megalite.perfmodel.flops.model_flops_per_token`: 6N + 12·L·h·s per token, N megalite's parameter count), so
the fractions compare time only.

The machine is shared: each repeat measures the matmul limit, then every implementation (order rotated) for K
steps, and a fraction is taken within its repeat; medians over repeats, with the spread.

    python bench/limit.py            # ~5-10 minutes on 2 cores (inductor compiles one model per size)
    python bench/limit.py --smoke    # seconds: one tiny size, dynamo's eager backend
Writes runs/bench/limit[_smoke].{json,md}, or into --out DIR.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_compare import (Dims, StepFn, build_hf, build_megalite, build_minimal, have_transformers,  # noqa: E402
                               make_batches, time_steps)
from bench.results_io import spread, write_results  # noqa: E402

from megalite.config import ModelArgs  # noqa: E402
from megalite.model.gpt import GPT, count_parameters  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.perfmodel.flops import model_flops_per_token  # noqa: E402

SIZES = {"S (2x128)": Dims(layers=2, hidden=128, heads=4, kv_heads=2), "M (4x256)": Dims(),
         "L (4x512)": Dims(layers=4, hidden=512, heads=8, kv_heads=4, batch=4)}


def matmul_limit(sizes: tuple[int, ...] = (1024, 2048), reps: int = 5) -> float:
    """The best fp32 GEMM FLOP/s over `sizes` (2 n^3 per product), best of `reps` each."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up: threads, pages
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def step_flops(d: Dims) -> float:
    """megalite's FLOPs of one training step of these dims (the count every implementation is credited with)."""
    cfg = ModelArgs(arch="llama", num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads,
                      num_kv_heads=d.kv_heads, ffn_hidden_size=d.ffn, seq_len=d.seq, vocab_size=d.vocab,
                      tie_embeddings=False, kernels="torch")
    n = count_parameters(GPT(cfg, ParallelState(), seed=0), ParallelState())
    return model_flops_per_token(n, d.layers, d.hidden, d.seq) * d.batch * d.seq


def builders(backend: str) -> dict[str, Callable[[Dims], StepFn]]:
    out: dict[str, Callable[[Dims], StepFn]] = {
        "megalite eager": lambda d: build_megalite(d, "llama"),
        "megalite compiled": lambda d: build_megalite(d, "llama", backend),
        "minimal torch loop": lambda d: build_minimal(d, "llama")}
    if have_transformers():
        out["transformers Llama"] = lambda d: build_hf(d, "llama")
    return out


def run_size(d: Dims, backend: str, warmup: int, repeats: int, steps: int, mm_sizes: tuple[int, ...]) -> dict:
    flops = step_flops(d)
    steps_fns = {name: build(d) for name, build in builders(backend).items()}
    batches = make_batches(d, steps)
    for fn in steps_fns.values():  # the compiled one compiles here (and recompiles once for the 2nd step)
        time_steps(fn, batches[:1] * warmup)
    names = list(steps_fns)
    fractions: dict[str, list[float]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    limits = []
    for r in range(repeats):
        limit = matmul_limit(mm_sizes)
        limits.append(limit)
        for name in names[r % len(names):] + names[:r % len(names)]:
            rate = flops * steps / time_steps(steps_fns[name], batches)
            rates[name].append(rate)
            fractions[name].append(rate / limit)
    return {"dims": vars(d), "step_gflop": flops / 1e9, "limit_gflops": spread([x / 1e9 for x in limits]),
            "gflops": {n: spread([x / 1e9 for x in v]) for n, v in rates.items()},
            "fraction": {n: spread(v) for n, v in fractions.items()}}


def to_markdown(res: dict) -> str:
    m = res["meta"]
    names = list(next(iter(res["sizes"].values()))["fraction"])
    lines = [f"Training-step FLOP/s as a fraction of this machine's fp32 matmul limit ({m['date']}, {m['machine']}, "
             f"{m['threads']} threads, load average {m['load_before']} before / {m['load_after']} after; compiled: "
             f"{m['backend']}; medians of {m['repeats']} paired repeats)", "",
             "| size | limit GFLOP/s | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for size, r in res["sizes"].items():
        cells = [f"{r['fraction'][n]['median']:.0%} ({r['gflops'][n]['median']:.1f})" for n in names]
        lines.append(f"| {size} | {r['limit_gflops']['median']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: fraction of the limit (GFLOP/s), every implementation credited with megalite's FLOP count."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    a = ap.parse_args(argv)
    sizes = {"tiny": Dims(layers=1, hidden=64, heads=2, kv_heads=1, seq=32, batch=2, vocab=256)} if a.smoke else SIZES
    mm_sizes = (256,) if a.smoke else (1024, 2048)
    backend, repeats, steps = ("eager", 1, 1) if a.smoke else (a.backend, a.repeats, a.steps)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": torch.get_num_threads(),
            "backend": backend, "repeats": repeats, "smoke": a.smoke, "load_before": round(os.getloadavg()[0], 1)}
    res = {"meta": meta, "sizes": {name: run_size(d, backend, 2, repeats, steps, mm_sizes) for name, d in sizes.items()}}
    meta["load_after"] = round(os.getloadavg()[0], 1)
    write_results(a.out, "limit" + ("_smoke" if a.smoke else ""), res, to_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
