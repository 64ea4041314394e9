"""A long sequence at context parallel sizes cp = 1, 2, 4 and cp modes ring / allgather / a2a / hybrid on CPU/gloo: peak
memory per rank and tokens/s, beside the estimator's prediction, and which sizes fit a memory budget.

Each cp size is one `torchrun` launch of `pretrain.py`'s entry point with cp ranks (dp = 1: every rank holds
S/cp tokens of the same sequences) for a few steps on the demo corpus; every layout gets the same cores
(threads per rank = cores / cp), so tokens/s compare the layouts, not the thread counts. From `metrics.jsonl`:
the median tokens/s (first step dropped: lazy init) and the last step's cp bytes; from each rank: its peak RSS.
Beside them the estimator's model states, activations and cp bytes per rank (`megalite.perfmodel`, fp32 as
pretrain.py runs on CPU), the activations twice: with the attention scores an unfused kernel keeps (Korthikanti
et al. 2022, the estimator's default), and without them, as SDPA's fused CPU kernel (cp = 1) and the ring's
blockwise math (cp > 1) run: they keep only the output and its log-sum-exp. Peak RSS also holds the
interpreter, torch and the data loader: the table shows that fixed part, measured in a process that imports
them and trains nothing, and what the run adds above it.

    python bench/cp_memory.py                           # seq 4096, llama 4 x 512, cp 1, 2, 4: minutes
    python bench/cp_memory.py --max-memory-gb 1.1       # which cp sizes fit 1.1 GB per rank
    python bench/cp_memory.py --render runs/bench/cp_memory.json --max-memory-gb 0.9   # another budget, no rerun
    python bench/cp_memory.py --estimate-only           # the estimator's half, no runs (seconds)
    python bench/cp_memory.py --modes ring,a2a           # only these cp modes (default: all four; hybrid runs
                                                        # a2a --cp-a2a (2) x ring at each cp above --cp-a2a)
    python bench/cp_memory.py --smoke                   # seq 256, a tiny model, cp 1 and cp 2 (a2a), 2 steps
Writes runs/bench/cp_memory.{json,md}, or into --out DIR (--out bench/results: the published table).
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
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.launch import run_script_ranks  # noqa: E402
from megalite.observability.metrics import peak_rss_bytes  # noqa: E402
from bench.results_io import write_results  # noqa: E402

MiB = 2**20
DEMO_BYTES = 3_000_000  # ~1M tokens of the demo corpus; 5% of it held out covers a 4096-token sample
# --smoke's 256-token sequences: ~100K tokens, 5% of them still cover a sample, and the tests' own demo corpus
# (tests/conftest.py SMALL_RUN: 300,000 bytes, vocab 512) is this one, so a MEGALITE_CACHE they share is reused.
SMOKE_DEMO_BYTES = 300_000


def worker(argv: list[str]) -> int:
    """One rank under torchrun: train via the trainer, then record this rank's peak RSS."""
    from megalite.training.trainer import main

    code = main(argv)
    rank = os.environ.get("RANK", "0")
    rss = peak_rss_bytes()  # VmHWM: ru_maxrss would carry torchrun's RSS over the fork
    log_dir = Path(argv[argv.index("--logging.dir") + 1])
    log_dir.mkdir(parents=True, exist_ok=True)  # a run refused before it made its directory
    (log_dir / f"rss_rank{rank}.json").write_text(json.dumps({"peak_rss_bytes": rss}))
    return code


def baseline_rss() -> int:
    """Peak RSS of a process that imports what a rank imports and trains nothing: the fixed part of a rank's RSS."""
    code = ("import torch, torch.distributed, megalite.training.trainer; "
            "from megalite.observability.metrics import peak_rss_bytes; print(peak_rss_bytes())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    return int(proc.stdout.strip() or 0)


def model_flags(a: argparse.Namespace) -> list[str]:
    return ["--data.demo_max_bytes", str(a.demo_bytes), "--data.demo_vocab_size", "512", "--data.valid_fraction", "0.05",
            "--model.num_layers", str(a.layers),
            "--model.hidden_size", str(a.hidden), "--model.num_heads", str(a.heads), "--model.num_kv_heads",
            str(a.kv_heads), "--model.seq_len", str(a.seq), "--train.micro_batch_size", "1",
            "--train.global_batch_size", "1", "--train.steps", str(a.steps), "--train.warmup_steps", "1",
            "--logging.interval", "1", "--train.eval_interval", "0", "--model.kernels", "torch",
            "--train.device", "cpu",
            "--train.memory_check", "false"]  # measured here, not refused: the unfused prediction is far above


def predict(flags: list[str], cp: int) -> dict[str, float]:
    """The estimator's bytes per rank for this run at `cp` (its config resolved as pretrain.py would; the cp
    mode is among `flags`)."""
    import dataclasses

    from megalite.config import parse_args, resolve
    from megalite.training.memory_check import run_estimate, tokenizer_vocab_size

    cfg = resolve(parse_args([*flags, "--parallel.cp", str(cp)]), cp)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer_vocab_size(cfg)))
    est = run_estimate(cfg)
    # Fused attention stores what selective recompute stores (Korthikanti et al. 2022: no 5as²b score terms),
    # without recomputing anything: its activation bytes are the selective-recompute ones.
    fused = run_estimate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="selective")))
    return {"model_states": est.memory.model_states, "activations": est.memory.activations,
            "activations_fused": fused.memory.activations, "cp_bytes": est.comm_bytes.get("cp", 0.0)}


def mode_flags(mode: str, a2a: int = 2) -> list[str]:
    return ["--parallel.cp_mode", mode] + (["--parallel.cp_a2a", str(a2a)] if mode == "hybrid" else [])


def run(cp: int, flags: list[str], cache: str, log_dir: Path, cores: int) -> dict:
    argv = ["--data.cache_dir", cache, *flags, "--parallel.cp", str(cp), "--logging.dir", str(log_dir)]
    # The same cores for every layout: cores // cp threads per rank.
    proc = run_script_ranks(Path(__file__).resolve(), cp, argv, max(1, cores // cp), timeout_s=3600)
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines() or ["?"]
        return {"skipped": f"run failed: {err[0].strip()[:300]}", "stderr_tail": proc.stderr[-3000:]}
    rows = [json.loads(ln) for ln in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rss = [json.loads(p.read_text())["peak_rss_bytes"] for p in sorted(log_dir.glob("rss_rank*.json"))]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:] or rows),
            "peak_rss_bytes_per_rank": rss, "cp_bytes_measured": rows[-1]["comm_bytes"].get("cp", 0.0),
            "final_loss": rows[-1]["loss"]}


def _mode(row: dict) -> str:
    if row["cp"] == 1:
        return "-"
    mode = row.get("mode", "ring")
    return f"hybrid {row['cp_a2a']} x {row['cp'] // row['cp_a2a']}" if mode == "hybrid" else mode


def to_markdown(res: dict) -> str:
    budget = res.get("max_memory_gb")
    load = res.get("load_average")
    where = f" on {res['machine']}" if res.get("machine") else ""
    lines = [f"Context parallelism on CPU/gloo: {res['model_desc']}; {res['date']}{where}, {res['cores']} cores shared "
             f"by each layout's ranks" + (f"; load average {load[0]:.1f} before, {load[1]:.1f} after" if load else "")
             + ".", "",
             "| cp | mode | tokens/rank | peak RSS/rank MiB (max) | above fixed MiB | predicted states MiB "
             "| predicted activations MiB, fused (unfused) | cp MB/step measured | predicted | tokens/s |"
             + (f" fits {budget:g} GB |" if budget else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if budget else "")]
    for r in res["rows"]:
        p = r["predicted"]
        pred = (f"{p['model_states'] / MiB:.0f} | {p['activations_fused'] / MiB:.0f} "
                f"({p['activations'] / MiB:.0f})")
        if "skipped" in r or "peak_rss_bytes_per_rank" not in r:
            why = r.get("skipped", "estimate only")
            lines.append(f"| {r['cp']} | {_mode(r)} | {r['tokens_per_rank']} | {why} | | {pred} | | {p['cp_bytes'] / 1e6:.3f} | |"
                         + (" |" if budget else ""))
            continue
        peak = max(r["peak_rss_bytes_per_rank"])
        fits = f" {'yes' if peak <= budget * 1e9 else 'no'} |" if budget else ""
        above = (peak - res["fixed_rss_bytes"]) / MiB
        lines.append(f"| {r['cp']} | {_mode(r)} | {r['tokens_per_rank']} | {peak / MiB:.0f} | {above:.0f} "
                     f"| {pred} | {r['cp_bytes_measured'] / 1e6:.3f} | {p['cp_bytes'] / 1e6:.3f} "
                     f"| {r['tokens_per_s']:.0f} |{fits}")
    lines.append(f"\nFixed part of a rank's RSS (interpreter, torch, megalite imported, nothing trained): "
                 f"{res['fixed_rss_bytes'] / MiB:.0f} MiB. Activations: fused = without the attention scores (SDPA's "
                 "fused CPU kernel at cp = 1, the ring's blockwise math at cp > 1 keep none), unfused = with them "
                 "(Korthikanti et al. 2022's 5as²b). MB = 1e6 wire bytes per rank per step.")
    if budget:
        fit = [str(r["cp"]) + (f" ({r['mode']})" if r["cp"] > 1 and "mode" in r else "") for r in res["rows"]
               if "peak_rss_bytes_per_rank" in r and max(r["peak_rss_bytes_per_rank"]) <= budget * 1e9]
        names = ", ".join(fit) or "none"
        lines.append(f"Budget {budget:g} GB per rank (measured peak RSS): cp = {names} fit.")
    return "\n".join(lines) + "\n"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", default="1,2,4", help="cp sizes, comma-separated (each run uses cp ranks)")
    p.add_argument("--modes", default="ring,allgather,a2a,hybrid", help="cp modes run at each cp > 1, comma-separated")
    p.add_argument("--cp-a2a", type=int, default=2, help="hybrid: cp ranks per all-to-all group (run where it < cp)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores each layout's ranks share")
    p.add_argument("--max-memory-gb", type=float, help="a per-rank budget: which cp sizes fit it (measured)")
    p.add_argument("--estimate-only", action="store_true", help="the estimator's columns only; nothing runs")
    p.add_argument("--render", type=Path, help="re-render a previous run's JSON (e.g. with another --max-memory-gb)")
    p.add_argument("--smoke", action="store_true", help="seq 256, 2 layers of 64, cp 1 and 2 (a2a), 2 steps")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                   help="output directory (default runs/bench, untracked; bench/results: the published table)")
    a = p.parse_args(argv)
    a.demo_bytes = DEMO_BYTES
    if a.smoke:
        a.seq, a.layers, a.hidden, a.heads, a.kv_heads, a.steps, a.cp = 256, 2, 64, 4, 2, 2, "1,2"
        a.demo_bytes = SMOKE_DEMO_BYTES
        # One cp > 1 launch: a ring row would run the same launch and byte check with another flag (the ring's
        # measured bytes equal the estimator's in tests/test_estimate_cp.py and tests/test_cp_pretrain.py).
        a.modes = "a2a"
    a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.mode_list or any(m not in ("ring", "allgather", "a2a", "hybrid") for m in a.mode_list):
        p.error(f"--modes {a.modes!r}: a comma-separated subset of ring, allgather, a2a, hybrid")
    if a.cp_a2a < 2:
        p.error("--cp-a2a must be >= 2")
    try:
        a.cp_sizes = [int(x) for x in a.cp.split(",") if x.strip()]
    except ValueError:
        a.cp_sizes = []
    bad = not a.cp_sizes or min(a.cp_sizes) < 1 or any(a.seq % (2 * c) for c in a.cp_sizes)
    if bad or min(a.seq, a.layers, a.hidden, a.heads, a.kv_heads, a.steps, a.cores) < 1:
        p.error(f"--cp {a.cp!r}: sizes >= 1 whose 2·cp chunks split --seq {a.seq}; every size > 0")
    if a.max_memory_gb is not None and not a.max_memory_gb > 0:
        p.error("--max-memory-gb must be > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        return worker(args[1:])
    a = parse(args)
    if a.render:
        res = {**json.loads(a.render.read_text()), "max_memory_gb": a.max_memory_gb}
        md = to_markdown(res)
        a.render.with_suffix(".md").write_text(md)
        print(md)
        return 0
    flags = model_flags(a)
    rows = [{"cp": cp, "mode": mode, "cp_a2a": a.cp_a2a, "tokens_per_rank": a.seq // cp,
             "predicted": predict(flags + mode_flags(mode, a.cp_a2a), cp)}
            for cp in a.cp_sizes for mode in (a.mode_list if cp > 1 else ["ring"])
            if mode != "hybrid" or (cp > a.cp_a2a and cp % a.cp_a2a == 0)]  # a2a 2 x ring 1 is a2a itself
    load_before = os.getloadavg()[0]
    res = {"date": datetime.date.today().isoformat(), "cores": a.cores, "max_memory_gb": a.max_memory_gb,
           "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cores)".replace("  ", " "),
           "model_desc": f"llama {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv), seq {a.seq}, "
                         f"micro-batch 1, demo vocab 512, fp32, {a.steps} steps", "rows": rows, "fixed_rss_bytes": 0}
    if not a.estimate_only:
        from megalite.data import prepare_demo_data

        res["fixed_rss_bytes"] = baseline_rss()
        with tempfile.TemporaryDirectory(prefix="megalite-cp-memory-") as tmp:
            cache = os.environ.get("MEGALITE_CACHE") or str(Path(tmp) / "cache")
            prepare_demo_data(cache, a.demo_bytes, 512)  # once, before any rank races to build it
            for row in rows:
                row.update(run(row["cp"], flags + mode_flags(row["mode"], a.cp_a2a), cache,
                               Path(tmp) / f"cp{row['cp']}_{row['mode']}", a.cores))
                print(json.dumps(row), flush=True)
    res["load_average"] = [load_before, os.getloadavg()[0]]
    stem = "cp_memory" + ("_smoke" if a.smoke else "") + ("_estimate" if a.estimate_only else "")
    write_results(a.out, stem, res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
