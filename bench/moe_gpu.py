"""MoE expert GEMMs on the GPU: `torch._grouped_mm` (megalite.moe.grouped.grouped_mm) vs the loop of matmuls.

For the expert shapes of the MoE presets (qwen3-30b-a3b: 128 experts of width 768 at h 2048, top-8;
mixtral-8x7b: 8 experts of width 14336 at h 4096, top-2), one micro-batch of T tokens routed uniformly at
random (each of the T k assignments to a random expert: the balanced case the estimator assumes), the experts'
forward + backward in bf16 (up GEMM, SwiGLU, down GEMM, all weight and input gradients): first the grouped
result checked equal to the loop's (bf16 round-off), then each timed; tokens/s and TFLOP/s (18 T k h F per
forward + backward). The all-to-all is not measured: at ep = 1 on one GPU it moves nothing (the 'ep' bytes
are counted and predicted, docs/moe.md). Sections past `--budget-s` are skipped; results are rewritten after
each preset.

    python bench/moe_gpu.py --budget-s 30      # bench/gpu.sh section 7 (one H200: ~30 s)
    python bench/moe_gpu.py --smoke            # anywhere: CPU, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.results_io import spread, write_results  # noqa: E402

from megalite.moe.grouped import can_group, grouped_mm, grouped_mm_loop  # noqa: E402

# (name, hidden, expert width, experts, top-k): the presets' expert shapes (megalite/config/presets.py)
PRESETS = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("mixtral-8x7b", 4096, 14336, 8, 2)]
SMOKE = [("tiny", 32, 64, 4, 2)]
BF16_RTOL = 2e-2  # the two paths round the same bf16 products in another order (fp32 accumulation in both)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def experts_step(mm: Callable[..., torch.Tensor], x: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 counts: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SwiGLU experts forward + backward on rows sorted by expert; returns (y, dx, dup, ddown)."""
    for t in (x, up, down):
        t.grad = None
    gate, lin = mm(x, up, counts).chunk(2, dim=-1)
    y = mm((F.silu(gate) * lin).contiguous(), down, counts)
    (y.float() * g).sum().backward()
    assert x.grad is not None and up.grad is not None and down.grad is not None
    return y.detach(), x.grad, up.grad, down.grad


def bench_preset(name: str, h: int, f: int, e: int, k: int, tokens: int, device: torch.device, iters: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    counts_cpu = torch.bincount(torch.randint(0, e, (tokens * k,), generator=gen), minlength=e)
    rows = int(counts_cpu.sum())
    dt = torch.bfloat16
    x = (torch.randn(rows, h, device=device) * 0.5).to(dt).requires_grad_(True)
    up = (torch.randn(e, 2 * f, h, device=device) * h ** -0.5).to(dt).requires_grad_(True)
    down = (torch.randn(e, h, f, device=device) * f ** -0.5).to(dt).requires_grad_(True)
    g = torch.randn(rows, h, device=device)
    if not can_group(x, up):
        return {"preset": name, "skipped": f"torch._grouped_mm does not apply on {device.type} here"}
    counts_dev, counts_list = counts_cpu.to(device), counts_cpu.tolist()
    paths: dict[str, Callable[[], tuple[torch.Tensor, ...]]] = {
        "grouped": lambda: experts_step(grouped_mm, x, up, down, counts_dev, g),
        "loop": lambda: experts_step(grouped_mm_loop, x, up, down, counts_list, g)}
    outs = {p: [t.float().clone() for t in fn()] for p, fn in paths.items()}  # also the warm-up
    errors = {}
    for i, what in enumerate(("output", "input_grad", "up_grad", "down_grad")):
        a, b = outs["grouped"][i], outs["loop"][i]
        errors[what] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not errors[what] < BF16_RTOL:
            raise AssertionError(f"{name}: grouped {what} differs from the loop's by {errors[what]:.2e}")
    del outs
    seconds: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(iters):
        for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):  # alternate the order
            _sync(device)
            start = time.perf_counter()
            paths[p]()
            _sync(device)
            seconds[p].append(time.perf_counter() - start)
    flops = 18.0 * tokens * k * h * f
    med = {p: spread(s)["median"] for p, s in seconds.items()}
    return {"preset": name, "dims": dict(hidden=h, expert_ffn=f, experts=e, top_k=k, tokens=tokens),
            "max_over_mean_rows": float(counts_cpu.max() / counts_cpu.float().mean()), "equal": errors,
            "seconds": {p: spread(s) for p, s in seconds.items()},
            "tokens_per_s": {p: tokens / t for p, t in med.items()},
            "tflops": {p: flops / t / 1e12 for p, t in med.items()},
            "loop_over_grouped": spread([lo / gr for lo, gr in zip(seconds["loop"], seconds["grouped"])])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one timing (seconds)")
    ap.add_argument("--budget-s", type=float, default=30.0, help="skip presets once this much time has passed")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (e.g. 2 x 4096)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    args = ap.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    presets, tokens, iters = (SMOKE, 64, 1) if args.smoke else (PRESETS, args.tokens, args.iters)
    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                    "machine": torch.cuda.get_device_name() if device.type == "cuda"
                                    else f"{platform.machine()} {os.cpu_count()} cores",
                                    "load_average": list(os.getloadavg()), "torch": torch.__version__,
                                    "smoke": args.smoke, "iters": iters},
                           "presets": []}
    stem = "moe_gpu_smoke" if args.smoke else "moe_gpu"
    for preset in presets:
        if time.monotonic() - start > args.budget_s:
            res["presets"].append({"preset": preset[0], "skipped": f"past the {args.budget_s:.0f} s budget"})
            continue
        res["presets"].append(bench_preset(*preset, tokens=tokens, device=device, iters=iters))
        write_results(Path(args.out), stem, res, to_markdown)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_results(Path(args.out), stem, res, to_markdown)
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"MoE expert GEMMs (bf16, forward + backward), {m['date']}, {m['machine']}, torch {m['torch']}, "
             f"median of {m['iters']}", "",
             "| preset | experts x width, top-k | tokens | grouped tokens/s | loop tokens/s | grouped TFLOP/s | "
             "loop / grouped time (min / median / max) | max err (bf16) |", "|---|---|---|---|---|---|---|---|"]
    for p in res["presets"]:
        if "skipped" in p:
            lines.append(f"| {p['preset']} | skipped: {p['skipped']} | | | | | | |")
            continue
        d, r = p["dims"], p["loop_over_grouped"]
        lines.append(f"| {p['preset']} | {d['experts']} x {d['expert_ffn']}, top-{d['top_k']} | {d['tokens']} | "
                     f"{p['tokens_per_s']['grouped']:.0f} | {p['tokens_per_s']['loop']:.0f} | "
                     f"{p['tflops']['grouped']:.1f} | {r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f} | "
                     f"{max(p['equal'].values()):.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
