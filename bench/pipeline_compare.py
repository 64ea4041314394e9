"""Pipeline schedules head to head on gloo/CPU, and against torch.distributed.pipelining: tokens/s of each
as a paired ratio to megalite's 1F1B and to torch's schedule of the same shape, CPU time per step, and the
peak in-flight activations per schedule, at pp=2 and pp=4 (one rank per stage, same model and batches).

One set of processes per pp runs every schedule (each with its own engine and optimizer, the same initial
weights) and, unless --no-peers, torch's Schedule1F1B / ScheduleGPipe / ScheduleInterleaved1F1B /
ScheduleZBVZeroBubble on the same chunks (`TorchPeer`). First 3 steps of each, whose losses must match
megalite's (the check also warms every run up), then R repeats of K steps each, the run order rotated every
repeat; ratios are paired per repeat, so machine-wide drift cancels; min/median/max over repeats, and the
fastest repeats' ratio (best / best). Step time is rank 0's wall clock between barriers; CPU time is every
rank's process time added up (waiting is not CPU time: it shows overhead even on a loaded machine). The load
average is printed before and after each pp.

What to expect: the simulator's bubble is the ceiling of the gain (tools/pipeline_timeline.py). On
CPU each extra action (ZB splits every backward in two; zbv has twice the stages, and each half-stage
pays the full per-call Python and gloo latency) costs fixed overhead, so small models can lose what
the bubble saves; larger layers and more micro-batches move the ratio toward the simulated one.

    python bench/pipeline_compare.py --repeats 5   # about 12 minutes on 2 cores
    python bench/pipeline_compare.py --smoke       # tiny dims (4 layers, M=4), 1 repeat of 1 step
Writes runs/bench/pipeline_compare{,_smoke}.{json,md} (--out bench/results to update the published figures).
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
from typing import Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.launch import spawn_ranks  # noqa: E402
from bench.results_io import spread, write_results  # noqa: E402

from torch.distributed import pipelining  # noqa: E402

from megalite.config import ModelArgs  # noqa: E402
from megalite.optim import build_distributed_optimizer  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.parallel.state import ParallelState, create_groups  # noqa: E402
from megalite.optim.zero import ZeroOptimizer  # noqa: E402
from megalite.pipeline import PipelineEngine, StagePlan, build_pipeline  # noqa: E402
from megalite.pipeline.simulate import simulate  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv")


# torch.distributed.pipelining's schedule for each megalite schedule that has one (same stage placement:
# interleaved puts stages r and r+P on rank r, ZB-V stages r and 2P-1-r). Its ZB-H1 counterpart,
# ScheduleInterleavedZeroBubble, needs several stages per rank, so zb-h1 has no peer here.
PEERS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B",
         "zbv": "ScheduleZBVZeroBubble"}


def _vpp(schedule: str) -> int:
    return 2 if schedule in ("interleaved", "zbv") else 1


def megalite_pipeline(cfg: ModelArgs, state: ParallelState, schedule: str, micro_batch: int, lr: float = 3e-4,
                      seed: int = 1234) -> tuple[PipelineEngine, ZeroOptimizer]:
    """megalite's engine for `schedule` on this rank's stage(s) and its optimizer (zero=0, fp32), as pretrain.py
    builds them (also used by bench/dist_compare.py against torch.distributed.pipelining)."""
    engine = build_pipeline(cfg, state, seed, micro_batch, torch.float32,
                            stages=StagePlan(vpp=_vpp(schedule), schedule=schedule))
    model = engine.chunks[0] if len(engine.chunks) == 1 else torch.nn.ModuleList(engine.chunks)
    return engine, build_distributed_optimizer(model, state, 0, torch.float32, OptimizerConfig())


class _PeerStage(torch.nn.Module):
    """A megalite model chunk as a torch pipelining stage: one tensor in (token ids on the first stage,
    hidden states elsewhere), one out (the logits on the last stage, for the schedule's loss_fn)."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x) if self.chunk.pre_process else self.chunk(None, hidden=x)


def _peer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class TorchPeer:
    """The same chunks (same init as megalite's engine for `schedule`) run by torch.distributed.pipelining,
    with torch's fused AdamW (megalite's decay rule: matrices only) and megalite's clipping: the global
    gradient norm over every stage, clipped to `clip`. One `step` = one optimizer step over M micro-batches."""

    def __init__(self, schedule: str, cfg: ModelArgs, state: ParallelState, micro_batch: int, num_micro: int,
                 seed: int, lr: float, clip: float) -> None:
        engine = build_pipeline(cfg, state, seed, micro_batch, torch.float32,
                                stages=StagePlan(vpp=_vpp(schedule), schedule=schedule))
        self.state, self.clip = state, clip
        self.first = 0 in engine.chunk_stages
        self.last = engine.num_stages - 1 in engine.chunk_stages
        mods = [_PeerStage(c) for c in engine.chunks]
        stages = [pipelining.PipelineStage(m, vs, engine.num_stages, state.device, group=state.group("pp"))
                  for m, vs in zip(mods, engine.chunk_stages)]
        cls = getattr(pipelining, PEERS[schedule])
        self.schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=num_micro, loss_fn=_peer_loss)
        self.params = [p for m in mods for p in m.parameters()]
        self.opt = torch.optim.AdamW([{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": 0.1},
                                      {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One training step; returns the mean loss over the micro-batches (on every rank)."""
        ids, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        losses: list[torch.Tensor] = []
        self.schedule.step(*((ids,) if self.first else ()), target=labels if self.last else None,
                           losses=losses if self.last else None)
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).square().sum()
        dist.all_reduce(sq, group=self.state.group("pp"))
        norm = sq.sqrt().item()
        if norm > self.clip:
            torch._foreach_mul_(grads, self.clip / (norm + 1e-6))  # megalite's factor (optim/zero.py)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().double() if self.last else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss, group=self.state.group("pp"))
        return loss.item()


CHECK_STEPS = 3
# megalite and its torch peer run the same chunks and batches; their losses differ only by the order of
# float32 sums (cross-entropy kernels, the norm's reduction, fused AdamW on flat vs per-tensor buffers):
# ~1e-6 on a loss of ~7.6 after 3 steps at lr 3e-4. A wrong stage wiring or a lost gradient is >= 1e-3.
LOSS_TOL = 1e-4


# How `measure` starts one set of ranks: (world, args) -> rank 0's `rank_results`. The default spawns `world`
# processes; the unit test passes its warm gloo pool instead (tests/dist_harness.py), which saves the smoke
# run three fresh Python processes (importing torch is most of a smoke run's CPU time).
Launch = Callable[[int, dict], dict]


def _worker(rank: int, world: int, port: int, args: dict, queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = rank_results(rank, world, args)
    if result is not None:
        queue.put(result)
    dist.destroy_process_group()


def spawned(port: int) -> Launch:
    """The default launch: `world` spawned processes on a gloo group over 127.0.0.1:`port`."""
    return lambda world, args: spawn_ranks(_worker, world, port, args)


def rank_results(rank: int, world: int, args: dict) -> dict | None:
    """Every schedule (and its torch peer) on this rank of a `world`-rank default group that already exists:
    the loss check, then the timed repeats; rank 0 returns the times, losses, CPU seconds and peaks."""
    state = ParallelState(tp=1, pp=world, dp=1, rank=rank)
    create_groups(state)
    d = SimpleNamespace(**args)
    cfg = ModelArgs(arch="llama", num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads, num_kv_heads=d.heads,
                      ffn_hidden_size=4 * d.hidden, seq_len=d.seq, vocab_size=d.vocab, tie_embeddings=False,
                      kernels="torch")
    tcfg = SimpleNamespace(lr=3e-4, min_lr=3e-4, warmup_steps=0, steps=10**9, clip_grad=1.0)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, d.vocab, (CHECK_STEPS + 1, d.micro_batches * d.micro_batch, d.seq + 1), generator=gen)
    steps_data = [[(x[i:i + d.micro_batch, :-1], x[i:i + d.micro_batch, 1:])
                   for i in range(0, x.shape[0], d.micro_batch)] for x in data]
    batches = steps_data[-1]  # the timed steps
    step = iter(range(10**9))
    runs: dict[str, Callable[[list], float]] = {}
    engines = {}
    for s in d.schedules:
        engines[s], opt = megalite_pipeline(cfg, state, s, d.micro_batch, tcfg.lr)
        engine = engines[s]
        engine.p2p_depth = d.p2p_depth
        ctx = StepContext.build(engine, state, torch.float32, tcfg, LossScaler(False), s)
        runs[s] = lambda b, ctx=ctx, opt=opt: train_step(ctx, opt, b, next(step)).loss
        if d.peers and s in PEERS:
            runs[f"torch-{s}"] = TorchPeer(s, cfg, state, d.micro_batch, d.micro_batches, 1234, tcfg.lr,
                                           tcfg.clip_grad).step
    losses = {name: [fn(b) for b in steps_data[:CHECK_STEPS]] for name, fn in runs.items()}  # also the warm-up
    for name, got in losses.items():
        ref = losses[name.removeprefix("torch-")]
        if max(abs(a - b) for a, b in zip(got, ref)) > LOSS_TOL:
            raise RuntimeError(f"{name} losses {got} differ from megalite's {ref} by more than {LOSS_TOL}")

    def run(name: str, steps: int) -> tuple[float, float]:
        """Wall seconds (between barriers) and this rank's CPU seconds for `steps` steps of `name`."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            runs[name](batches)
        c1 = time.process_time()
        dist.barrier()
        return time.perf_counter() - t0, c1 - c0

    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu = torch.zeros(len(names), d.repeats, dtype=torch.float64)
    for r in range(d.repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotated: drift hits every run alike
            wall, cpu[names.index(n), r] = run(n, d.steps)
            times[n].append(wall)
    dist.all_reduce(cpu)  # CPU seconds of all ranks together: robust to a loaded machine (waiting is not CPU)
    peaks = torch.tensor([float(engines[s].peak_in_flight) for s in d.schedules])
    gathered = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    if rank != 0:
        return None
    return {"times": times, "losses": losses, "cpu": {n: cpu[i].tolist() for i, n in enumerate(names)},
            "peak_in_flight": {s: [int(g[i]) for g in gathered] for i, s in enumerate(d.schedules)}}



def measure(pp: int, args: dict, launch: Launch) -> dict:
    load_before = os.getloadavg()[0]
    result = launch(pp, args)
    tokens = args["micro_batches"] * args["micro_batch"] * args["seq"] * args["steps"]
    times = result["times"]
    out = {"pp": pp, "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0], "losses": result["losses"], "rows": []}
    for s in args["schedules"]:
        # tokens/s(a) / tokens/s(b) = time(b) / time(a), paired per repeat
        row = {"schedule": s, "tokens_per_s": tokens / statistics.median(times[s]),
               "peak_in_flight": result["peak_in_flight"][s],
               "simulated_bubble": simulate(s, pp, args["micro_batches"], _vpp(s)).bubble_fraction}
        if "1f1b" in times:
            row["ratio_to_1f1b"] = spread([b / a for a, b in zip(times[s], times["1f1b"])])
        row["cpu_ms_per_step"] = 1e3 * statistics.median(result["cpu"][s]) / args["steps"]
        if f"torch-{s}" in times:
            peer = f"torch-{s}"
            row["torch_tokens_per_s"] = tokens / statistics.median(times[peer])
            row["ratio_to_torch"] = spread([b / a for a, b in zip(times[s], times[peer])])
            row["best_ratio_to_torch"] = min(times[peer]) / min(times[s])  # load only ever slows a run down
            row["torch_cpu_ms_per_step"] = 1e3 * statistics.median(result["cpu"][peer]) / args["steps"]
            row["cpu_ratio_to_torch"] = spread([b / a for a, b in zip(result["cpu"][s], result["cpu"][peer])])
        out["rows"].append(row)
    return out


def _q(r: dict, key: str) -> str:
    q = r.get(key)
    return f"{q['min']:.3f} / **{q['median']:.3f}** / {q['max']:.3f}" if q else "-"


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# Pipeline schedules on gloo/CPU{' (SMOKE: tiny, not a measurement)' if res['smoke'] else ''}", "",
             f"{res['date']}; llama {a['layers']} layers, hidden "
             f"{a['hidden']}, seq {a['seq']}, M={a['micro_batches']} micro-batches of {a['micro_batch']}; "
             f"{a['repeats']} repeats x {a['steps']} steps, every run in turn, order rotated per repeat. "
             "Ratios are tokens/s over the other's in the same repeat (min / **median** / max): to megalite's 1F1B, "
             "and to torch.distributed.pipelining's schedule of the same shape (same chunks, init and batches; "
             f"losses equal to {LOSS_TOL} over {CHECK_STEPS} steps, checked first). Peak in flight per rank "
             "(micro-batch chunks held, F until its W or whole B). Simulated bubble at t_F = t_B = t_W. CPU ms/step: "
             "all ranks' CPU time together (waiting is not CPU, so it shows overhead even on a loaded machine). "
             "best / best: the fastest repeat of each (background load only ever slows a run down).", ""]
    if res.get("note"):
        lines += [res["note"] + ".", ""]
    for table in res["results"]:
        lines += [f"## pp={table['pp']} (load average {table['load_avg_before']:.2f} before, "
                  f"{table['load_avg_after']:.2f} at the end)", "",
                  "| schedule | tokens/s | ratio to 1F1B | torch peer | its tokens/s | ratio to torch peer | best / best "
                  "| CPU ms/step (torch) | CPU ratio torch/megalite | peak in flight per rank | simulated bubble |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in table["rows"]:
            peer = PEERS.get(r["schedule"], "-") if "ratio_to_torch" in r else "-"
            torch_tps = f"{r['torch_tokens_per_s']:.0f}" if "torch_tokens_per_s" in r else "-"
            torch_cpu = f" ({r['torch_cpu_ms_per_step']:.0f})" if "torch_cpu_ms_per_step" in r else ""
            best = f"{r['best_ratio_to_torch']:.3f}" if "best_ratio_to_torch" in r else "-"
            lines.append(f"| {r['schedule']} | {r['tokens_per_s']:.0f} | {_q(r, 'ratio_to_1f1b')} | {peer} | {torch_tps} "
                         f"| {_q(r, 'ratio_to_torch')} | {best} | {r['cpu_ms_per_step']:.0f}{torch_cpu} | {_q(r, 'cpu_ratio_to_torch')} "
                         f"| {r['peak_in_flight']} | {100 * r['simulated_bubble']:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None, launch: Launch | None = None) -> int:
    """The command line; `launch` replaces the spawned ranks (every pp then uses it, and --port is unused)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated megalite schedules")
    ap.add_argument("--no-peers", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--repeats", type=int, help="paired repeats (default 3; smoke 1)")
    ap.add_argument("--steps", type=int, help="steps per run and repeat (default 2; smoke 1)")
    ap.add_argument("--micro-batches", type=int, help="M (default 16; smoke 4)")
    ap.add_argument("--p2p-depth", type=int, default=1, help="receives megalite posts ahead (0: only the next one)")
    ns = ap.parse_args(argv)
    args = (dict(layers=4, hidden=32, heads=4, seq=16, vocab=128, micro_batch=1, micro_batches=4, repeats=1, steps=1)
            if ns.smoke else
            dict(layers=8, hidden=256, heads=4, seq=128, vocab=2048, micro_batch=2, micro_batches=16, repeats=3, steps=2))
    args.update({k: v for k, v in (("repeats", ns.repeats), ("steps", ns.steps), ("micro_batches", ns.micro_batches))
                 if v is not None})
    args.update(schedules=[s for s in ns.schedules.split(",") if s], peers=not ns.no_peers, p2p_depth=ns.p2p_depth)
    unknown = set(args["schedules"]) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}: expected some of {', '.join(SCHEDULES)}")
    results = [measure(int(pp), args, launch or spawned(ns.port + i)) for i, pp in enumerate(ns.pp.split(","))]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": ns.smoke,
           "args": args, "results": results}
    write_results(Path(ns.out), "pipeline_compare_smoke" if ns.smoke else "pipeline_compare", res, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
