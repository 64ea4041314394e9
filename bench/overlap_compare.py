"""Overlapped vs non-overlapped DP communication, side by side: bucket sizing, the ZeRO-1/2 parameter
gather overlap and ZeRO-3's prefetch depth (`megalite.dp.overlap`), at dp = 2.

Every variant is its own model + optimizer in the same two processes (same init, same batches); the
losses of the two sides of each comparison are checked equal (bitwise: at dp = 2 every DP sum is of two
values, so moving a collective in time changes no bit) before anything is timed. Then R repeats of K
steps each, the variant order rotated every repeat; a ratio is paired per repeat (baseline step time /
variant step time = the variant's tokens/s over the baseline's), so machine-wide drift cancels; min /
median / max over repeats. Step time is rank 0's wall clock between barriers.

    python bench/overlap_compare.py                      # CPU/gloo, a few minutes on 2 cores
    python bench/overlap_compare.py --smoke              # tiny dims, 1 repeat: seconds
    python bench/overlap_compare.py --device cuda        # what bench/gpu.sh runs: NCCL on 2 GPUs, or
                                                         # gloo on one GPU (NCCL refuses 2 ranks per GPU)
Writes runs/bench/overlap_compare{,_smoke,_cuda}.{json,md} (--out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.launch import spawn_ranks  # noqa: E402
from bench.results_io import spread, write_results  # noqa: E402

from megalite.config import ModelArgs  # noqa: E402
from megalite.dp.overlap import MiB, OverlapSettings  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.optim import SyncOptions, build_distributed_optimizer  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.parallel.state import ParallelState, create_groups  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

# name -> zero and the OverlapSettings (the rest at their defaults: 1 MiB first bucket, 25 MiB
# buckets, gathers overlapped, ZeRO-3 prefetch 1).
VARIANTS: dict[str, dict[str, Any]] = {
    "z0 one bucket": dict(zero=0, first_bucket_bytes=25 * MiB),  # the reduction waits for the last gradient
    "z0 first 1 MiB": dict(zero=0),                               # the defaults
    "z0 1+4 MiB": dict(zero=0, bucket_bytes=4 * MiB),
    "z1 gathers waited": dict(zero=1, bucket_bytes=4 * MiB, param_gather=False),
    "z1 gathers overlapped": dict(zero=1, bucket_bytes=4 * MiB),
    "z2 gathers waited": dict(zero=2, bucket_bytes=4 * MiB, param_gather=False),
    "z2 gathers overlapped": dict(zero=2, bucket_bytes=4 * MiB),
    "z3 prefetch 0": dict(zero=3, zero3_prefetch=0),
    "z3 prefetch 1": dict(zero=3, zero3_prefetch=1),
    "z3 prefetch 2": dict(zero=3, zero3_prefetch=2),
}
# (variant, its baseline): ratio = tokens/s of the variant over the baseline's in the same repeat
PAIRS = [("z0 first 1 MiB", "z0 one bucket"), ("z0 1+4 MiB", "z0 one bucket"),
         ("z1 gathers overlapped", "z1 gathers waited"), ("z2 gathers overlapped", "z2 gathers waited"),
         ("z3 prefetch 0", "z3 prefetch 1"), ("z3 prefetch 2", "z3 prefetch 1")]


def _worker(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    if args["device"] == "cuda":
        torch.cuda.set_device(torch.device("cuda", rank % torch.cuda.device_count()))
    dist.init_process_group(args["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = measure_on_rank(rank, world, args)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def measure_on_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's part of `measure`, in a process whose default group spans the `world` ranks (tests run it in
    their warm gloo ranks); rank 0 returns the timings, the others None."""
    d = SimpleNamespace(**args)
    torch.set_num_threads(d.threads)
    cuda = d.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    state = ParallelState(tp=1, pp=1, dp=world, rank=rank, device=device)
    create_groups(state)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = ModelArgs(arch="llama", num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads,
                      num_kv_heads=d.heads, ffn_hidden_size=-(-int(8 * d.hidden / 3) // 64) * 64, seq_len=d.seq,
                      vocab_size=d.vocab, tie_embeddings=False, kernels="torch")
    tcfg = SimpleNamespace(lr=3e-4, min_lr=3e-4, warmup_steps=0, steps=10**9, clip_grad=1.0)
    gen = torch.Generator().manual_seed(0)
    rows = d.micro_batches * d.micro_batch
    data = torch.randint(0, d.vocab, (world * rows, d.seq + 1), generator=gen)[rank * rows:(rank + 1) * rows]
    batches = [(data[i:i + d.micro_batch, :-1].to(device), data[i:i + d.micro_batch, 1:].to(device))
               for i in range(0, rows, d.micro_batch)]
    runs = {}
    for name, v in VARIANTS.items():
        model = GPT(cfg, state, seed=1234).to(device)
        settings = {k: x for k, x in v.items() if k != "zero"}
        opt = build_distributed_optimizer(model, state, v["zero"], dtype, OptimizerConfig(),
                                          sync=SyncOptions(OverlapSettings(**settings)))
        runs[name] = (StepContext.build(model, state, dtype, tcfg, LossScaler(False)), opt, len(opt.sync.buckets))
    step = iter(range(10**9))

    def run(name: str, steps: int) -> tuple[float, float, list[float]]:
        """Wall seconds, this process's CPU seconds (all its threads, gloo's included), losses."""
        ctx, opt, _ = runs[name]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses = [train_step(ctx, opt, batches, next(step)).loss for _ in range(steps)]
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter() - t0, time.process_time() - c0, losses

    # Equal losses first (warm-up too): two steps of each variant from the same initial weights.
    losses = {name: run(name, 2)[2] for name in VARIANTS}
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(d.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu_s, _ = run(name, d.steps)
            times[name].append(wall)
            cpu[name].append(cpu_s)
    for _, opt, _ in runs.values():
        opt.finish_param_sync()  # no gather in flight when the process group goes
    if rank != 0:
        return None
    return {"times": times, "cpu": cpu, "losses": losses, "buckets": {n: runs[n][2] for n in names},
            "params": sum(p.numel() for p in runs[names[0]][0].engine.chunks[0].parameters())}


def measure(args: dict[str, Any], port: int) -> dict[str, Any]:
    result = spawn_ranks(_worker, 2, port, args)
    for variant, base in PAIRS:
        if result["losses"][variant] != result["losses"][base]:
            raise RuntimeError(f"{variant} vs {base}: losses differ {result['losses'][variant]} "
                               f"!= {result['losses'][base]}: not the same computation, not timed")
    tokens = args["micro_batches"] * args["micro_batch"] * args["seq"] * args["steps"] * 2  # both ranks
    t = result["times"]
    rows = [{"variant": n, "buckets": result["buckets"][n], "tokens_per_s": tokens / statistics.median(t[n]),
             "step_s_median": statistics.median(t[n]) / args["steps"],
             "cpu_s_per_step": statistics.median(result["cpu"][n]) / args["steps"]} for n in VARIANTS]
    ratios = []
    for variant, base in PAIRS:
        r = [b / a for a, b in zip(t[variant], t[base])]
        ratios.append({"variant": variant, "baseline": base, **spread(r)})
    return {"rows": rows, "ratios": ratios, "params": result["params"], "losses": result["losses"]}


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    smoke = " (SMOKE: tiny, not a measurement)" if res["smoke"] else ""
    lines = [f"# Overlapped vs non-overlapped DP communication, {a['device']}/{a['backend']}, dp=2{smoke}", "",
             f"{res['date']}, load average {res['load_average']}; llama {a['layers']} layers, hidden {a['hidden']}, "
             f"seq {a['seq']}, vocab {a['vocab']} ({res['params'] / 1e6:.2f}M params, "
             f"{res['params'] * 4 / MiB:.1f} MiB of fp32 grads), M={a['micro_batches']} micro-batches of "
             f"{a['micro_batch']} per rank, {a['threads']} thread(s) per rank; {a['repeats']} repeats x "
             f"{a['steps']} steps, order rotated; losses of each pair checked equal (bitwise) before timing.", "",
             "| variant | buckets | tokens/s (both ranks) | step s | CPU s per step (rank 0) |", "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['buckets']} | {r['tokens_per_s']:.0f} | {r['step_s_median']:.3f} | "
              f"{r['cpu_s_per_step']:.3f} |" for r in res["rows"]]
    lines += ["", "| variant / baseline (tokens/s, paired per repeat) | min | median | max |", "|---|---|---|---|"]
    lines += [f"| {q['variant']} / {q['baseline']} | {q['min']:.3f} | {q['median']:.3f} | {q['max']:.3f} |"
              for q in res["ratios"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--repeats", type=int, default=0, help="0 = 7 on CPU, 3 on CUDA, 1 with --smoke")
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("overlap_compare: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    if ns.smoke:
        args = dict(layers=2, hidden=32, heads=4, seq=16, vocab=256, micro_batch=2, micro_batches=2, repeats=1, steps=1)
    elif ns.device == "cuda":  # 92M params: 10 variants x 2 ranks fit one GPU; ~14 buckets of 25 MiB
        args = dict(layers=6, hidden=1024, heads=8, seq=1024, vocab=8192, micro_batch=2, micro_batches=2,
                    repeats=3, steps=1)
    else:
        args = dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096, micro_batch=4, micro_batches=2,
                    repeats=7, steps=2)
    args["repeats"] = ns.repeats or args["repeats"]
    # NCCL needs one GPU per rank; with one GPU the two ranks share it and talk through gloo (host copies).
    args.update(device=ns.device, threads=1 if ns.device == "cpu" else 4,
                backend="nccl" if ns.device == "cuda" and torch.cuda.device_count() >= 2 else "gloo")
    res: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "smoke": ns.smoke, "args": args, "load_average": [round(x, 2) for x in os.getloadavg()]}
    res.update(measure(args, ns.port))
    stem = "overlap_compare" + ("_smoke" if ns.smoke else "") + ("_cuda" if ns.device == "cuda" else "")
    write_results(Path(ns.out), stem, res, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
