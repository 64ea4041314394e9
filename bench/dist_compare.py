"""megalite against the torch-native distributed peers, 2 ranks on gloo/CPU, layout by layout.

For each layout megalite and its peer (bench/dist_peers.py) are built in the same two processes from the same
initial weights (megalite's layout-invariant init, copied into the peer) and fed the same batches. First each
trains 3 steps and the losses must agree within LOSS_TOL, or the run stops: a comparison of different
computations would mean nothing. Then R repeats of K steps each, the two (megalite first, then the peer, the
order rotated every repeat), so machine-wide drift cancels in the paired ratio megalite tokens/s / peer tokens/s
(min / median / max over repeats). Per rank and step it also records CPU seconds (the process's, all threads),
bytes written to sockets (`/proc/self/io` wchar, megalite.observability.wire) and, for megalite, the bytes
counted by the ring convention; with --memory (default outside --smoke) each implementation's peak RSS per rank
is measured in its own pair of processes. The load average is printed: on a busy machine ratios are noisy.

    python bench/dist_compare.py --smoke                       # tiny dims, 1 repeat: well under a minute
    python bench/dist_compare.py --out bench/results           # the published figures (see its header)
    python bench/dist_compare.py --layouts ddp,tp-sp           # a subset (names: --help)
Writes runs/bench/dist_compare{,_smoke}.{json,md} unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench import dist_peers as peers  # noqa: E402
from bench.pipeline_compare import megalite_pipeline  # noqa: E402
from bench.results_io import spread, write_results  # noqa: E402
from megalite.config import ModelArgs  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.observability.wire import process_written_bytes  # noqa: E402
from megalite.optim import build_distributed_optimizer  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.parallel.state import ParallelState, create_groups  # noqa: E402
from megalite.runtime.malloc import tune_malloc  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

SEED, CHECK_STEPS = 1234, 3
# fp32 on both sides, the same math in other summation orders (fused vs separate projections, a vocab-parallel
# vs a gathered softmax, another reduction order): the first loss agrees to ~1e-6; AdamW then turns round-off in
# the smallest gradients into relative update differences, which after 3 steps move an O(7) loss by ~1e-5.
# Real differences are far larger: DDP without its gradient reduction parted by 3.5e-2 (smoke dims), a clip that
# did not clip by 4.5e-3 (full dims), both at step 3 with lr 1e-3.
LOSS_TOL = 2e-4


@dataclass(frozen=True)
class Layout:
    name: str
    peer: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"


WORLD = 2
LAYOUTS = [Layout("ddp", "DDP", dp=2), Layout("zero1", "ZeroRedundancyOptimizer", dp=2, zero=1),
           Layout("zero2", "FSDP2 reshard_after_forward=False", dp=2, zero=2),
           Layout("zero3", "FSDP2 reshard_after_forward=True", dp=2, zero=3),
           Layout("tp", "DTensor TP", tp=2), Layout("tp-sp", "DTensor TP+SP", tp=2, sp=True),
           Layout("pp-1f1b", "pipelining Schedule1F1B", pp=2),
           Layout("pp-interleaved", "pipelining ScheduleInterleaved1F1B", pp=2, schedule="interleaved"),
           Layout("ds-zero1", "DeepSpeed ZeRO-1", dp=2, zero=1), Layout("ds-zero2", "DeepSpeed ZeRO-2", dp=2, zero=2),
           Layout("ds-zero3", "DeepSpeed ZeRO-3", dp=2, zero=3)]
BY_NAME = {lay.name: lay for lay in LAYOUTS}


def model_config(d: peers.Dims) -> ModelArgs:
    return ModelArgs(arch="llama", num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads,
                       num_kv_heads=d.kv_heads, ffn_hidden_size=d.ffn, seq_len=d.seq, vocab_size=d.vocab,
                       tie_embeddings=False, kernels="torch")


def rank_batches(d: peers.Dims, lay: Layout, rank: int, k: int) -> list[list[peers.Batch]]:
    """k steps of this rank's micro-batches: dp splits the global batch, tp gives every rank all of it,
    pp cuts it into micro-batches of one sequence (M = batch)."""
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(k):
        t = torch.randint(0, d.vocab, (d.batch, d.seq + 1), generator=g)
        if lay.dp > 1:
            t = t.chunk(lay.dp)[rank]
        rows = 1 if lay.pp > 1 else t.shape[0]
        steps.append([(t[i:i + rows, :-1].contiguous(), t[i:i + rows, 1:].contiguous())
                      for i in range(0, t.shape[0], rows)])
    return steps


def build_megalite(d: peers.Dims, lay: Layout, rank: int) -> tuple[peers.StepFn, ParallelState]:
    state = ParallelState(tp=lay.tp, pp=lay.pp, dp=lay.dp, rank=rank, sp=lay.sp)
    create_groups(state)
    cfg = model_config(d)
    if lay.pp > 1:
        engine, opt = megalite_pipeline(cfg, state, lay.schedule, micro_batch=1, lr=peers.LR, seed=SEED)
    else:
        engine = GPT(cfg, state, seed=SEED)
        opt = build_distributed_optimizer(engine, state, lay.zero, torch.float32,
                                          OptimizerConfig(weight_decay=peers.WD, beta1=peers.BETAS[0],
                                                          beta2=peers.BETAS[1], adam_eps=peers.EPS))
    settings = SimpleNamespace(lr=peers.LR, min_lr=peers.LR, warmup_steps=0, steps=10**9, clip_grad=peers.CLIP)
    ctx = StepContext.build(engine, state, torch.float32, settings, LossScaler(False), lay.schedule)
    step = iter(range(10**9))
    return (lambda batches: train_step(ctx, opt, batches, next(step)).loss), state


def build_peer(d: peers.Dims, lay: Layout) -> peers.StepFn:
    full = GPT(model_config(d), ParallelState(), seed=SEED).state_dict()  # megalite's weights, unsharded
    if lay.pp > 1:
        return peers.build_pipelining(d, full, lay.schedule == "interleaved", d.batch)
    model = peers.Llama(d)
    peers.load_megalite_weights(model, full, d)
    if lay.name.startswith("ds-"):
        return peers.build_deepspeed(model, lay.zero, d.batch // lay.dp)
    if lay.tp > 1:
        return peers.build_tensor_parallel(model, lay.sp)
    if lay.zero >= 2:
        return peers.build_fsdp2(model, reshard_after_forward=lay.zero == 3)
    return peers.build_ddp(model, zero_redundancy=lay.zero == 1)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _timed(fn: peers.StepFn, batches: list[list[peers.Batch]], steps: int) -> tuple[float, float, int, list[float]]:
    """(wall s for the job, this process's CPU s, bytes it wrote, losses) over `steps` steps."""
    dist.barrier()
    t0, c0, w0 = time.perf_counter(), time.process_time(), process_written_bytes() or 0
    losses = [fn(batches[i % len(batches)]) for i in range(steps)]
    c1, w1 = time.process_time(), process_written_bytes() or 0
    dist.barrier()  # the job's step ends when its slowest rank is done
    return time.perf_counter() - t0, c1 - c0, w1 - w0, losses


def run_layout(d: peers.Dims, lay: Layout, rank: int, repeats: int, steps: int) -> dict:
    batches = rank_batches(d, lay, rank, CHECK_STEPS)
    mega, state = build_megalite(d, lay, rank)
    impls = {"megalite": mega, "peer": build_peer(d, lay)}
    # The check (also the warm-up) trains on one batch 3 times: the loss falls visibly, so an implementation that
    # skipped or mis-averaged the gradient reduction would part from the other at once.
    check = {name: [fn(batches[0]) for _ in range(CHECK_STEPS)] for name, fn in impls.items()}
    worst = max(abs(a - b) for a, b in zip(check["megalite"], check["peer"]))
    if worst > LOSS_TOL:
        raise RuntimeError(f"{lay.name}: losses differ by {worst:.2e} > {LOSS_TOL} before timing: "
                           f"megalite {check['megalite']} vs {lay.peer} {check['peer']}")
    out: dict = {"check_losses": check, "max_loss_diff": worst,
                 **{k: {n: [] for n in impls} for k in ("seconds", "cpu_s", "written")}, "counted": []}
    names = list(impls)
    for r in range(repeats):
        for name in names[r % 2:] + names[:r % 2]:  # rotate: each goes first in half the repeats
            state.counter.reset()
            wall, cpu, written, _ = _timed(impls[name], batches, steps)
            out["seconds"][name].append(wall)
            out["cpu_s"][name].append(cpu / steps)
            out["written"][name].append(written / steps)
            if name == "megalite":
                out["counted"].append(sum(state.counter.bytes().values()) / steps)
    return out


def import_everything(with_deepspeed: bool) -> None:
    """Load what any contender imports and touch the lazily loaded CPU kernels, so that a memory probe counts
    the implementation, not the libraries it happens to import first (the same for megalite and its peer)."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.functional as F

    if with_deepspeed:
        import deepspeed  # noqa: F401
    w = torch.randn(1, 2, 8, 8, requires_grad=True)
    att = F.scaled_dot_product_attention(w, w, w, is_causal=True).view(-1, 8)
    F.cross_entropy(att, torch.zeros(16, dtype=torch.long)).backward()
    torch.optim.AdamW([w], fused=True).step()


def memory_probe(d: peers.Dims, lay: Layout, impl: str, rank: int, steps: int) -> dict:
    """Peak RSS of one implementation alone: every library imported, the kernel's high-water mark reset
    (/proc/self/clear_refs, Linux >= 4.0), then build and train `steps` steps. `peak_mib` is the process's
    (python + torch + the model, its gradients, optimizer states and activations); `delta_mib` the peak over the
    resident size after the imports. The peer's figure includes megalite's tp=1 model built for its initial
    weights (freed before training: one model copy, 16 MB at the default dims)."""
    import_everything(lay.name.startswith("ds-"))
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    fn = build_megalite(d, lay, rank)[0] if impl == "megalite" else build_peer(d, lay)
    batches = rank_batches(d, lay, rank, 1)
    for _ in range(steps):
        fn(batches[0])
    peak = _status_kib("VmHWM")
    return {"peak_mib": peak / 1024, "delta_mib": (peak - base) / 1024}


def _worker(rank: int, port: int, job: dict, queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)  # two ranks on two cores
    warnings.filterwarnings("ignore", category=FutureWarning)  # the peers' deprecation notices, once per call
    # What torchrun would set; DeepSpeed insists on LOCAL_RANK.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    tune_malloc()  # what pretrain.py does; process-wide, so the peer runs with the same allocator settings
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    try:
        result = run_job(rank, job)
    except Exception as exc:  # reported by the parent with the rank; the peers may be stuck: it kills them
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    queue.put((rank, result))
    dist.destroy_process_group()


def run_job(rank: int, job: dict) -> dict:
    """One rank's part of `job`, in a process whose default group spans the WORLD ranks (`_worker` starts it;
    tests run it in their warm gloo ranks)."""
    d = peers.Dims(**job["dims"])
    if job["mode"] == "memory":
        return memory_probe(d, BY_NAME[job["layout"]], job["impl"], rank, job["steps"])
    result: dict = {}
    for name in job["layouts"]:
        result[name] = run_layout(d, BY_NAME[name], rank, job["repeats"], job["steps"])
        if rank == 0:
            print(f"  {name}: done", flush=True)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: dict, timeout: float = 7200) -> list[dict]:
    """Run `job` on WORLD fresh processes; their results by rank (an error in any rank stops everything)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, job, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    try:
        while len(got) < WORLD:
            rank, res = queue.get(timeout=timeout)
            if "error" in res:
                raise RuntimeError(f"rank {rank}: {res['error']}")
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30 if len(got) == WORLD else 1)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(WORLD)]



def summarize(d: peers.Dims, lay: Layout, per_rank: list[dict], steps: int) -> dict:
    r0 = per_rank[0]
    tokens = d.batch * d.seq * steps
    ratios = [p / m for m, p in zip(r0["seconds"]["megalite"], r0["seconds"]["peer"])]  # tokens/s ratio, paired
    impl = {n: {"tokens_per_s": spread([tokens / s for s in r0["seconds"][n]]),
                "cpu_s_per_step": [statistics.median(r["cpu_s"][n]) for r in per_rank],
                "written_bytes_per_step": [statistics.median(r["written"][n]) for r in per_rank]}
            for n in ("megalite", "peer")}
    impl["megalite"]["counted_bytes_per_step"] = [statistics.median(r["counted"]) for r in per_rank]
    return {"layout": asdict(lay), "ratio": spread(ratios), "ratios": ratios, "max_loss_diff": r0["max_loss_diff"],
            "check_losses": r0["check_losses"], **impl}


def _mem(mem: dict[str, list[float]], impl: str) -> str:
    if impl not in mem:
        return "-"
    return (", ".join(f"{x:.0f}" for x in mem[impl])
            + (" (" + ", ".join(f"{x:.0f}" for x in mem[impl + "_delta"]) + ")" if impl + "_delta" in mem else ""))


def to_markdown(res: dict) -> str:
    d = res["dims"]
    smoke = " (SMOKE: tiny dims, not a measurement)" if res["smoke"] else ""
    lines = [f"# megalite vs torch-native peers, {WORLD} ranks on gloo/CPU{smoke}", "",
             f"{res['date']}, {res['machine']}, {res['cpu_count']} cores, torch {res['torch']}; load average "
             f"{res['load_before']} before, {res['load_after']} after. llama {d['layers']} layers, hidden "
             f"{d['hidden']}, heads {d['heads']} (kv {d['kv_heads']}), seq {d['seq']}, {d['batch']} sequences per "
             f"step, vocab {d['vocab']}, fp32, AdamW + clip; {res['repeats']} paired repeats x {res['steps']} steps, "
             f"order rotated; losses equal within {LOSS_TOL} for {CHECK_STEPS} steps before timing. "
             "Ratio = megalite tokens/s / peer tokens/s in the same repeat (min / median / max). CPU s, bytes "
             "written (MB = 1e6, `/proc/self/io` wchar) and peak RSS per rank (rank 0, rank 1; in parentheses: over "
             "the RSS after importing every contender's libraries, i.e. what the implementation itself costs). "
             "Peers: torch "
             f"{res['torch']}, DeepSpeed {res.get('deepspeed') or 'not run'}. `python bench/dist_compare.py "
             f"{'--smoke ' if res['smoke'] else ''}--out DIR` took {res['runtime_s']:.0f} s.", "",
             "| layout | peer | ratio min / median / max | megalite tok/s | peer tok/s | CPU s/step megalite | "
             "CPU s/step peer | MB written megalite (counted) | MB written peer | peak MiB megalite | peak MiB peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def pair(xs: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
        return ", ".join(f"{x / scale:{fmt}}" for x in xs)

    for row in res["rows"]:
        m, p, q = row["megalite"], row["peer"], row["ratio"]
        mem = res["memory"].get(row["layout"]["name"], {})
        lines.append(
            f"| {row['layout']['name']} | {row['layout']['peer']} | {q['min']:.3f} / **{q['median']:.3f}** / "
            f"{q['max']:.3f} | {m['tokens_per_s']['median']:.0f} | {p['tokens_per_s']['median']:.0f} | "
            f"{pair(m['cpu_s_per_step'])} | {pair(p['cpu_s_per_step'])} | "
            f"{pair(m['written_bytes_per_step'], 1e6, '.2f')} ({pair(m['counted_bytes_per_step'], 1e6, '.2f')}) | "
            f"{pair(p['written_bytes_per_step'], 1e6, '.2f')} | "
            f"{_mem(mem, 'megalite')} | {_mem(mem, 'peer')} |")
    lines += [f"\nNote: {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny dims, 1 repeat of 1 step, no memory probes")
    ap.add_argument("--layouts", default=",".join(BY_NAME), help=f"comma-separated subset of {', '.join(BY_NAME)}")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2, help="steps per implementation per repeat")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                    help="peak RSS per implementation in its own processes (default: on, off with --smoke)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                    help="output directory (default runs/bench, untracked; bench/results: the published figures)")
    ap.add_argument("--render", type=Path, help="only rewrite the markdown next to this results JSON")
    a = ap.parse_args(argv)
    if a.render:
        res = json.loads(a.render.read_text())
        res.setdefault("deepspeed", _version("deepspeed"))
        a.render.with_suffix(".md").write_text(to_markdown(res))
        return 0
    unknown = [n for n in a.layouts.split(",") if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {', '.join(BY_NAME)}")
    d = peers.Dims(layers=4, hidden=32, heads=4, kv_heads=2, seq=16, batch=4, vocab=128) if a.smoke else peers.Dims()
    repeats, steps = (1, 1) if a.smoke else (a.repeats, a.steps)
    memory = (not a.smoke) if a.memory is None else a.memory
    names, notes = a.layouts.split(","), []
    why_not = peers.deepspeed_available() if any(n.startswith("ds-") for n in names) else None
    if why_not:
        names = [n for n in names if not n.startswith("ds-")]
        notes.append(f"DeepSpeed layouts skipped: {why_not}")
    load_before = os.getloadavg()
    print(f"dist_compare: layouts {', '.join(names)}; load average {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}", flush=True)
    started = time.perf_counter()
    job = {"mode": "time", "dims": asdict(d), "layouts": names, "repeats": repeats, "steps": steps}
    per_rank = launch(job)
    rows = [summarize(d, BY_NAME[n], [r[n] for r in per_rank], steps) for n in names]
    mem: dict[str, dict[str, list[float]]] = {}
    for n in names if memory else []:
        for impl in ("megalite", "peer"):
            probe = launch({"mode": "memory", "dims": asdict(d), "layout": n, "impl": impl, "steps": 2})
            mem.setdefault(n, {})[impl] = [p["peak_mib"] for p in probe]
            mem[n][impl + "_delta"] = [p["delta_mib"] for p in probe]
    load_after = os.getloadavg()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": a.smoke,
           "machine": f"{platform.machine()} {platform.processor()}".strip(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "dims": asdict(d),
           "deepspeed": _version("deepspeed") if any(n.startswith("ds-") for n in names) else None,
           "repeats": repeats, "steps": steps,
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after],
           "runtime_s": round(time.perf_counter() - started, 1), "rows": rows, "memory": mem, "notes": notes}
    write_results(a.out, "dist_compare_smoke" if a.smoke else "dist_compare", res, to_markdown)
    print(f"dist_compare: {res['runtime_s']} s; load average now {load_after[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
