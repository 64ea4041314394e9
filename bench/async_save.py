"""How long a checkpoint save blocks the training loop, synchronous vs `checkpoint.async_save`, and what it costs.

One process, the llama-160m preset's dims (12 layers, h=768, ffn 2048, vocab 32000: ~134M params, fp32, Adam
state present: ~1.6 GB per checkpoint), `train_step` on micro-batches of 1 x --seq-len tokens (the preset's
2048-token sequence is shortened so a CPU step takes seconds; the save does not depend on it). Per repeat:

- sync: the time `save_sharded` takes: the loop waits for all of it;
- async: the time the loop spends in the save (`plan_save` + the copy to host buffers, pinned on a GPU), then
  training steps run while the background thread writes; recorded: the write's duration, the steps it
  overlapped and their mean time next to steps with no write (on a CPU the writer's copy, sha256 and page-cache
  work share the cores with training: that slowdown is part of the price, shown, not hidden);
- extra memory: the host buffers the async saver keeps (one copy of the rank's share, reused by every save).

    python bench/async_save.py            # several minutes on 2 shared cores
    python bench/async_save.py --smoke    # seconds: tiny model, 1 repeat
Writes <out>/async_save.{json,md} (default runs/bench; --out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bench.checkpoint_io import _cpu_name, _model_cfg, describe  # noqa: E402
from bench.results_io import spread, write_results  # noqa: E402
from megalite.checkpoint.async_save import AsyncSaver  # noqa: E402
from megalite.checkpoint.sharded import plan_save, save_sharded  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.optim.reference import ReferenceOptimizer  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.pipeline import build_pipeline  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

FULL = {"preset": "llama-160m", "vocab_size": 32000}
SMOKE = {"preset": "tiny", "vocab_size": 512}


def _settings(steps: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(lr=1e-4, min_lr=1e-4, warmup_steps=0, steps=steps, clip_grad=1.0)


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(model: dict[str, Any], seq_len: int, repeats: int, root: Path, device: str) -> dict[str, Any]:
    cfg = _model_cfg(dict(model, seq_len=seq_len), 1)
    state = ParallelState(tp=1, pp=1, dp=1, rank=0, device=torch.device(device))
    engine = build_pipeline(cfg, state, seed=1, micro_batch_size=1, dtype=torch.float32)
    net = nn.ModuleList(engine.chunks)
    opt = ReferenceOptimizer(net, state, 1e-4, 0.1, (0.9, 0.95), 1e-8)
    ctx = StepContext.build(engine, state, torch.float32, _settings(10 ** 6), LossScaler(False), "1f1b")
    gen = torch.Generator().manual_seed(0)
    n = 0

    def step() -> float:
        nonlocal n
        data = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=gen).to(device)
        t0 = time.perf_counter()
        train_step(ctx, opt, [(data[:, :-1], data[:, 1:])], n)
        if device == "cuda":
            torch.cuda.synchronize()
        n += 1
        return time.perf_counter() - t0

    step()  # Adam moments exist from here on: every save writes params + exp_avg + exp_avg_sq
    extra = {"sampler": {"consumed_samples": 0}, "rng": {"cpu": torch.get_rng_state()}}
    res: dict[str, Any] = {"sync_block_s": [], "async_block_s": [], "write_s": [], "steps_during_write": [],
                           "step_s_during_write": [], "step_s_alone": [], "load_before": _load()}
    for i in range(repeats):
        t0 = time.perf_counter()
        path = save_sharded(root / "sync", i + 1, net, opt, extra, state, keep=1)
        res["sync_block_s"].append(time.perf_counter() - t0)
        res["checkpoint_bytes"] = sum(f.stat().st_size for f in path.iterdir())
    saver = AsyncSaver(state, 900.0, pin=device == "cuda")
    for i in range(repeats):
        t0 = time.perf_counter()
        saver.submit(plan_save(root / "async", i + 1, net, opt, extra, state, keep=1))
        res["async_block_s"].append(time.perf_counter() - t0)
        during: list[float] = []
        while saver.busy() is not None:  # training goes on while the write runs
            during.append(step())
        _, outcome = saver.wait()
        assert outcome is not None and outcome.error is None, outcome
        res["write_s"].append(outcome.write_s)
        res["steps_during_write"].append(len(during))
        res["step_s_during_write"] += during
        res["step_s_alone"] += [step() for _ in range(max(1, min(3, len(during))))]
    res["host_buffer_bytes"] = saver.buffers.nbytes
    res["load_after"] = _load()
    return res


def to_markdown(res: dict[str, Any]) -> str:
    sync, asyn = spread(res["sync_block_s"]), spread(res["async_block_s"])
    during = statistics.mean(res["step_s_during_write"]) if res["step_s_during_write"] else float("nan")
    alone = statistics.mean(res["step_s_alone"])
    gb = res["checkpoint_bytes"] / 1e9
    return "\n".join([
        "# Checkpoint save: time the training loop is blocked, sync vs async",
        "",
        f"Date {res['date']}. Machine: {res['machine']}; device {res['device']}; load average (1/5/15 min) "
        f"{res['load_before']} before, {res['load_after']} after (a shared machine: other jobs ran meanwhile)."
        + (" **Smoke run: tiny model, not a measurement.**" if res["smoke"] else ""),
        "",
        f"Model: {res['model']}; fp32 params + Adam moments, {gb:.2f} GB per checkpoint; train steps of "
        f"1 x {res['seq_len']} tokens. {res['repeats']} saves per mode; median (min..max).",
        "",
        "| | loop blocked per save, s | |",
        "|---|---:|---|",
        f"| sync (`checkpoint.async_save false`) | {sync['median']:.3f} ({sync['min']:.3f}..{sync['max']:.3f}) "
        "| write + fsync + sha256 + rename |",
        f"| async (`checkpoint.async_save true`) | {asyn['median']:.3f} ({asyn['min']:.3f}..{asyn['max']:.3f}) "
        "| plan + copy to host buffers |",
        "",
        f"Ratio sync / async (medians): {sync['median'] / asyn['median']:.0f}x less time blocked. The background "
        f"write took {spread(res['write_s'])['median']:.2f} s (median), overlapping "
        f"{statistics.median(res['steps_during_write']):.0f} training steps; those steps took {during:.2f} s on "
        f"average vs {alone:.2f} s with no write running ({(during / alone - 1) * 100:+.0f}%: the writer shares "
        "the cores and the memory bandwidth).",
        "",
        f"Extra memory: {res['host_buffer_bytes'] / 1e9:.2f} GB of host buffers (one copy of the rank's share of "
        "the checkpoint: params, exp_avg, exp_avg_sq in fp32; pinned on a GPU), allocated at the first save and "
        "reused by every later one.",
        "",
        "Reproduce: `python bench/async_save.py` (`--smoke` for a seconds-long check).",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 repeat: seconds")
    ap.add_argument("--repeats", type=int, default=3, help="saves per mode")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per training step (one sequence)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                    help="output directory (default runs/bench, untracked; bench/results: the published figures)")
    args = ap.parse_args(argv)
    model = SMOKE if args.smoke else FULL
    repeats = 1 if args.smoke else args.repeats
    root = Path(tempfile.mkdtemp(prefix="megalite-async-bench-"))
    try:
        res = measure(model, 16 if args.smoke else args.seq_len, repeats, root, args.device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    res.update(date=time.strftime("%Y-%m-%d", time.gmtime()), smoke=args.smoke, repeats=repeats,
               seq_len=16 if args.smoke else args.seq_len, model=describe(model)[0], device=device,
               machine=f"{platform.system()} {platform.machine()} ({_cpu_name()}), {os.cpu_count()} CPU cores, "
                       f"torch {torch.__version__}, checkpoint on {tempfile.gettempdir()}")
    write_results(args.out, "async_save_smoke" if args.smoke else "async_save", res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
