"""Pipeline schedules head to head on gloo/CPU: tokens/s of each as a paired ratio to 1F1B, and the
peak in-flight activations per schedule, at pp=2 and pp=4 (one rank per stage, same model and batch).

One set of processes per pp runs every schedule (each with its own engine and optimizer, the same
initial weights): warm-up, then R repeats of K steps each, the schedule order rotated every repeat;
ratios are paired per repeat (schedule / 1F1B in the same repeat), so machine-wide drift cancels;
min/median/max over repeats. Step time is rank 0's wall clock between barriers.

What to expect: the simulator's bubble is the ceiling of the gain (tools/pipeline_timeline.py). On
CPU each extra action (ZB splits every backward in two; zbv has twice the stages, and each half-stage
pays the full per-call Python and gloo latency) costs fixed overhead, so small models can lose what
the bubble saves; larger layers and more micro-batches move the ratio toward the simulated one.

    python bench/pipeline_compare.py            # a few minutes on 2 cores
    python bench/pipeline_compare.py --smoke    # tiny dims, 1 repeat of 1 step: seconds
Writes runs/bench/pipeline_compare{,_smoke}.{json,md} (--out bench/results to update the published figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from megalite.config import ModelConfig  # noqa: E402
from megalite.optim import build_distributed_optimizer  # noqa: E402
from megalite.optim.adamw import LossScaler  # noqa: E402
from megalite.parallel.state import ParallelState, create_groups  # noqa: E402
from megalite.optim.zero import ZeroOptimizer  # noqa: E402
from megalite.pipeline import PipelineEngine, build_pipeline  # noqa: E402
from megalite.pipeline.simulate import simulate  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv")


def _vpp(schedule: str) -> int:
    return 2 if schedule in ("interleaved", "zbv") else 1


def megalite_pipeline(cfg: ModelConfig, state: ParallelState, schedule: str, micro_batch: int, lr: float = 3e-4,
                      seed: int = 1234) -> tuple[PipelineEngine, ZeroOptimizer]:
    """megalite's engine for `schedule` on this rank's stage(s) and its optimizer (zero=0, fp32), as pretrain.py
    builds them (also used by bench/dist_compare.py against torch.distributed.pipelining)."""
    engine = build_pipeline(cfg, state, seed, micro_batch, torch.float32, vpp=_vpp(schedule), schedule=schedule)
    model = engine.chunks[0] if len(engine.chunks) == 1 else torch.nn.ModuleList(engine.chunks)
    return engine, build_distributed_optimizer(model, state, 0, lr, 0.1, (0.9, 0.95), 1e-8, torch.float32)


def _worker(rank: int, world: int, port: int, args: dict, queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = ParallelState(tp=1, pp=world, dp=1, rank=rank)
    create_groups(state)
    d = SimpleNamespace(**args)
    cfg = ModelConfig(arch="llama", num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads, num_kv_heads=d.heads,
                      ffn_hidden_size=4 * d.hidden, seq_len=d.seq, vocab_size=d.vocab, tie_embeddings=False,
                      kernels="torch")
    tcfg = SimpleNamespace(lr=3e-4, min_lr=3e-4, warmup_steps=0, steps=10**9, clip_grad=1.0)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, d.vocab, (d.micro_batches * d.micro_batch, d.seq + 1), generator=gen)
    batches = [(data[i:i + d.micro_batch, :-1], data[i:i + d.micro_batch, 1:])
               for i in range(0, data.shape[0], d.micro_batch)]
    runs = {s: megalite_pipeline(cfg, state, s, d.micro_batch) for s in SCHEDULES}
    step = iter(range(10**9))

    def run(s: str, steps: int) -> float:
        engine, opt = runs[s]
        dist.barrier()
        t0 = time.perf_counter()
        ctx = StepContext.build(engine, state, torch.float32, tcfg, LossScaler(False), s)
        for _ in range(steps):
            train_step(ctx, opt, batches, next(step))
        dist.barrier()
        return time.perf_counter() - t0

    for s in SCHEDULES:
        run(s, 1)  # warm-up: lazy init, allocator
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for r in range(d.repeats):
        order = SCHEDULES[r % len(SCHEDULES):] + SCHEDULES[:r % len(SCHEDULES)]
        for s in order:
            times[s].append(run(s, d.steps))
    peaks = torch.tensor([float(runs[s][0].peak_in_flight) for s in SCHEDULES])
    gathered = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    if rank == 0:
        queue.put({"times": times, "peak_in_flight": {s: [int(g[i]) for g in gathered] for i, s in enumerate(SCHEDULES)}})
    dist.destroy_process_group()


def measure(pp: int, args: dict, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, pp, port, args, queue)) for r in range(pp)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank exited with {p.exitcode}")
    tokens = args["micro_batches"] * args["micro_batch"] * args["seq"] * args["steps"]
    out = {"pp": pp, "rows": []}
    for s in SCHEDULES:
        ratios = [b / a for a, b in zip(result["times"][s], result["times"]["1f1b"])]  # tokens/s(s) / tokens/s(1f1b)
        out["rows"].append({
            "schedule": s, "tokens_per_s": tokens / statistics.median(result["times"][s]),
            "ratio_to_1f1b": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
            "peak_in_flight": result["peak_in_flight"][s],
            "simulated_bubble": simulate(s, pp, args["micro_batches"], _vpp(s)).bubble_fraction})
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# Pipeline schedules on gloo/CPU{' (SMOKE: tiny, not a measurement)' if res['smoke'] else ''}", "",
             f"{res['date']}; llama {a['layers']} layers, hidden {a['hidden']}, seq {a['seq']}, "
             f"M={a['micro_batches']} micro-batches of {a['micro_batch']}; {a['repeats']} repeats x {a['steps']} steps; "
             "ratio = tokens/s over 1F1B's in the same repeat (min / median / max). Peak in flight per rank "
             "(micro-batch chunks held, F until its W or whole B). Simulated bubble at t_F = t_B = t_W.", ""]
    for table in res["results"]:
        lines += [f"## pp={table['pp']}", "", "| schedule | tokens/s | ratio to 1F1B | peak in flight per rank | simulated bubble |",
                  "|---|---|---|---|---|"]
        for r in table["rows"]:
            q = r["ratio_to_1f1b"]
            lines.append(f"| {r['schedule']} | {r['tokens_per_s']:.0f} | {q['min']:.3f} / {q['median']:.3f} / "
                         f"{q['max']:.3f} | {r['peak_in_flight']} | {100 * r['simulated_bubble']:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--pp", default="2,4")
    ns = ap.parse_args(argv)
    args = (dict(layers=8, hidden=32, heads=4, seq=16, vocab=128, micro_batch=1, micro_batches=8, repeats=1, steps=1)
            if ns.smoke else
            dict(layers=8, hidden=256, heads=4, seq=128, vocab=2048, micro_batch=2, micro_batches=16, repeats=3, steps=2))
    results = [measure(int(pp), args, ns.port + i) for i, pp in enumerate(ns.pp.split(","))]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": ns.smoke,
           "args": args, "results": results}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "pipeline_compare_smoke" if ns.smoke else "pipeline_compare"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
