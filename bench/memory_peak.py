"""Predicted peak memory (megalite.perfmodel.peak_memory) against the measured peak, per rank, case by case.

Each case is one fresh launch of `pretrain.py`'s entry point (torchrun when it has several ranks) for a few steps on
the demo corpus. Measured: on CPU each rank process's RSS high-water, /proc/self/status VmHWM (`peak_rss_bytes`; ru_maxrss carries the launcher's RSS over the fork);
on GPU `torch.cuda.max_memory_allocated` and `torch.cuda.max_memory_reserved` (both recorded, the prediction's
`allocated` and `reserved` beside them). Predicted: `megalite.training.memory_check.predicted_peak` for the same
config, the same call the check before step 1 makes. The ratio is predicted / measured, worst rank.

    python bench/memory_peak.py                        # every case (minutes; < 15 on 2 shared cores)
    python bench/memory_peak.py --cases tiny,pp2-zbv   # some of them
    python bench/memory_peak.py --write-docs           # also replace the table in docs/estimator.md
Writes runs/bench/memory_peak.{json,md} (or --out DIR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

if sys.argv[1:2] == ["--worker"]:  # a rank runs as pretrain.py does: glibc's tcache off (megalite/runtime/malloc.py)
    from megalite.runtime.malloc import exec_with_malloc_tunables

    exec_with_malloc_tunables()

from bench.launch import run_script_ranks  # noqa: E402
from megalite.observability.metrics import peak_rss_bytes  # noqa: E402
from bench.results_io import write_results  # noqa: E402

MiB = 2**20
DEMO_BYTES = 1_000_000
# The mid-size model of the layout cases: 8 layers (pp 2 x vpp 2 divides them), hidden 384, seq 256, 4 sequences per
# step in micro-batches of 1 (4 micro-batches: every pipeline schedule fills).
MID = ["--model.num_layers", "8", "--model.hidden_size", "384", "--model.num_heads", "6", "--model.seq_len", "256",
       "--train.micro_batch_size", "1", "--train.global_batch_size", "4"]
# The outside check's shapes (issue 43): llama-160m's dims cut to 4 layers, 512 tokens, micro-batch 2 (at one rank,
# tp 2 + SP and dp 2 ZeRO-2), and gpt2-small's cut to 6 layers, 256 tokens, micro-batch 4, full recompute.
LLAMA4 = ["--model.preset", "llama-160m", "--model.num_layers", "4", "--model.seq_len", "512",
          "--train.micro_batch_size", "2", "--train.global_batch_size", "2"]
CASES: dict[str, tuple[int, list[str]]] = {
    "tiny": (1, ["--model.preset", "tiny"]),
    "gpt2-tiny": (1, ["--model.preset", "gpt2-tiny"]),
    "llama-160m": (1, ["--model.preset", "llama-160m", "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
                       "--model.recompute", "selective", "--data.demo_max_bytes", "3000000"]),  # 2048-token samples
    "llama4": (1, LLAMA4),
    "llama4-tp2-sp": (2, [*LLAMA4, "--parallel.tp", "2", "--parallel.sp", "true"]),
    "llama4-dp2-zero2": (2, [*LLAMA4, "--parallel.dp", "2", "--parallel.zero", "2", "--train.global_batch_size", "4"]),
    "gpt2s6-full-recompute": (1, ["--model.preset", "gpt2-small", "--model.num_layers", "6", "--model.seq_len", "256",
                                  "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
                                  "--model.recompute", "full"]),
    "mid": (1, MID),
    "mid-selective-recompute": (1, [*MID, "--model.recompute", "selective"]),
    "mid-full-recompute": (1, [*MID, "--model.recompute", "full"]),
    "mid-fp8": (1, [*MID, "--fp8.recipe", "tensorwise", "--fp8.min_dim", "128"]),
    "mid-muon": (1, [*MID, "--optimizer.name", "muon"]),
    "tp2": (2, [*MID, "--parallel.tp", "2"]),
    "tp2-sp": (2, [*MID, "--parallel.tp", "2", "--parallel.sp", "true"]),
    "pp2-gpipe": (2, [*MID, "--parallel.pp", "2", "--parallel.schedule", "gpipe"]),
    "pp2-1f1b": (2, [*MID, "--parallel.pp", "2", "--parallel.schedule", "1f1b"]),
    "pp2-interleaved": (2, [*MID, "--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.schedule", "interleaved"]),
    "pp2-zbh1": (2, [*MID, "--parallel.pp", "2", "--parallel.schedule", "zb-h1"]),
    "pp2-zbv": (2, [*MID, "--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.schedule", "zbv"]),
    "dp2-zero0": (2, [*MID, "--parallel.dp", "2", "--parallel.zero", "0"]),
    "dp2-zero1": (2, [*MID, "--parallel.dp", "2", "--parallel.zero", "1"]),
    "dp2-zero2": (2, [*MID, "--parallel.dp", "2", "--parallel.zero", "2"]),
    "dp2-zero3": (2, [*MID, "--parallel.dp", "2", "--parallel.zero", "3"]),
    "cp2-ring": (2, [*MID, "--parallel.cp", "2", "--parallel.cp_mode", "ring"]),
    "cp2-allgather": (2, [*MID, "--parallel.cp", "2", "--parallel.cp_mode", "allgather"]),
    "cp2-a2a": (2, [*MID, "--parallel.cp", "2", "--parallel.cp_mode", "a2a"]),
    "cp2-hybrid": (2, [*MID, "--parallel.cp", "2", "--parallel.cp_mode", "hybrid", "--parallel.cp_a2a", "2"]),
    # tiny-moe's 8 experts of width 384 over ep 2 (dp 2): experts and their ZeRO states split over ep
    "ep2-moe": (2, [*MID, "--model.preset", "tiny-moe", "--moe.ffn_hidden_size", "384", "--parallel.dp", "2",
                    "--parallel.ep", "2", "--train.global_batch_size", "4"]),
}


def common_flags(cache: str, steps: int) -> list[str]:
    return ["--data.cache_dir", cache, "--data.demo_max_bytes", str(DEMO_BYTES), "--train.steps", str(steps),
            "--train.warmup_steps", "1", "--logging.interval", "1", "--train.eval_interval", "0",
            "--model.kernels", "torch", "--train.memory_check", "false"]  # measured, not refused


def worker(argv: list[str]) -> int:
    """One rank: train via the trainer, then write this rank's measured peaks next to its metrics."""
    import torch

    from megalite.training.trainer import main

    code = main(argv)
    rank = os.environ.get("RANK", "0")
    out: dict[str, float] = {"peak_rss_bytes": peak_rss_bytes()}  # VmHWM, not ru_maxrss (megalite/observability)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        out["cuda_max_memory_reserved"] = torch.cuda.max_memory_reserved()
    log_dir = Path(argv[argv.index("--logging.dir") + 1])
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"peak_rank{rank}.json").write_text(json.dumps(out))
    return code


def predict(world: int, argv: list[str]) -> dict:
    """The check before step 1's prediction for this run (the tokenizer's vocabulary, as the run sizes it)."""
    from megalite.config import parse_args, resolve
    from megalite.training.memory_check import predicted_peak, tokenizer_vocab_size

    cfg = resolve(parse_args(argv), world)
    cfg.model.vocab_size = tokenizer_vocab_size(cfg)
    return predicted_peak(cfg).to_dict()


def measure(world: int, argv: list[str], log_dir: Path, threads: int) -> dict:
    """Launch the case fresh and read back every rank's peaks; {"skipped": why} when the run failed."""
    proc = run_script_ranks(Path(__file__).resolve(), world, [*argv, "--logging.dir", str(log_dir)], threads,
                            timeout_s=1800)
    peaks = [json.loads(p.read_text()) for p in sorted(log_dir.glob("peak_rank*.json"))]
    if proc.returncode != 0 or len(peaks) != world:
        lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines() or ["?"]
        return {"skipped": f"run failed: {lines[-1].strip()[:300]}"}
    return {"ranks": peaks}


def case_row(name: str, world: int, flags: list[str], cache: str, tmp: Path, steps: int,
             threads: int) -> dict:
    argv = [*common_flags(cache, steps), *flags]
    row: dict = {"case": name, "world": world, "flags": " ".join(flags), "predicted": predict(world, argv)}
    row.update(measure(world, argv, tmp / name, threads))
    if "ranks" in row:
        key = "cuda_max_memory_allocated" if "cuda_max_memory_allocated" in row["ranks"][0] else "peak_rss_bytes"
        row["measured_name"] = key
        row["measured"] = max(r[key] for r in row["ranks"])
        pred = row["predicted"]["allocated" if key.startswith("cuda") else "total"]
        row["ratio"] = pred / row["measured"]
    return row


def to_markdown(res: dict) -> str:
    out = [f"{res['date']}, {res['machine']}, load average {res['load_before']} before / {res['load_after']} after, "
           f"{res['steps']} steps per case, {res['threads']} thread(s) per rank, fp32, demo vocab 2048, "
           f"measured = {res['measured_name']} (worst rank)", "",
           "| case | ranks | predicted MiB | measured MiB | predicted / measured | peak phase | largest terms |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "skipped" in r:
            out.append(f"| {r['case']} | {r['world']} | {r['predicted']['total'] / MiB:.0f} | - | - | - | "
                       f"{r['skipped']} |")
            continue
        terms = sorted(r["predicted"]["terms"].items(), key=lambda kv: -kv[1])[:3]
        desc = ", ".join(f"{k} {v / MiB:.0f}" for k, v in terms)
        out.append(f"| {r['case']} | {r['world']} | {r['predicted']['total'] / MiB:.0f} | {r['measured'] / MiB:.0f} | "
                   f"{r['ratio']:.3f} | {r['predicted']['peak_phase']} | {desc} |")
    ok = [r for r in res["rows"] if "ratio" in r]
    if ok:
        worst = max(ok, key=lambda r: abs(r["ratio"] - 1))
        out += ["", f"{sum(abs(r['ratio'] - 1) <= 0.10 for r in ok)} of {len(ok)} cases within 10%; the worst is "
                f"{worst['case']} at {worst['ratio']:.3f}."]
    out += ["", "What no test holds: the measured peak is the heap's extent (RSS), which the allocator sets by the order "
            "and timing of allocations (glibc's holes between kept blocks); tests/test_memory_terms.py holds the "
            "saved activations and ZeRO's buffers exactly, tests/test_estimate_vs_measured.py the model states, this "
            "benchmark the whole against RSS."]
    return "\n".join(out) + "\n"


def write_docs(md: str) -> None:
    """Replace the table between the markers in docs/estimator.md."""
    path = REPO / "docs" / "estimator.md"
    text = path.read_text()
    start, end = "<!-- memory_peak table -->", "<!-- /memory_peak table -->"
    if start not in text:
        raise SystemExit(f"{path}: no {start} marker")
    head, rest = text.split(start, 1)
    path.write_text(head + start + "\n" + md + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        return worker(args[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names (default: all)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(args)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    from megalite.data import prepare_demo_data

    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
                 "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "steps": a.steps, "threads": a.threads,
                 "rows": []}
    with tempfile.TemporaryDirectory(prefix="megalite-memory-peak-") as tmp:
        cache = str(Path(tmp) / "cache")
        for size in {int(f[f.index("--data.demo_max_bytes") + 1]) if "--data.demo_max_bytes" in f else DEMO_BYTES
                     for _, f in (CASES[n] for n in names)}:
            prepare_demo_data(cache, size, 2048)  # here, not in a measured rank (a tokenizer trained there is RSS)
        for name in names:
            world, flags = CASES[name]
            row = case_row(name, world, flags, cache, Path(tmp), a.steps, a.threads)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "predicted"}), flush=True)
    res["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res["measured_name"] = next((r["measured_name"] for r in res["rows"] if "measured_name" in r), "-")
    md = write_results(a.out, "memory_peak", res, to_markdown)
    if a.write_docs:
        write_docs(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
