"""FP8 on one GPU (bench/gpu.sh's fp8 section): bf16 vs tensorwise vs rowwise FP8 tokens/s and MFU of the
llama-1b preset (megalite's train_step), and the speedup of each GEMM shape, so that `fp8.min_dim` is
set from measurements.

Per shape [M tokens, K in] x [K, N out]: the bf16 matmul, `_scaled_mm` alone (operands already in FP8) and
the whole FP8 linear forward + backward (quantisation and amaxes included) vs the bf16 linear's. MFU is over
the bf16 dense peak, as in metrics.jsonl (docs/fp8.md); the FP8 dense peak is recorded beside it.

    python bench/fp8_gpu.py --out runs/bench          # on the GPU (~1 minute)
    python bench/fp8_gpu.py --smoke --out /tmp/x      # anywhere: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import write_results  # noqa: E402

from megalite.config import ModelArgs  # noqa: E402
from megalite.config.presets import PRESETS  # noqa: E402
from megalite.fp8 import scaled_mm as smm  # noqa: E402
from megalite.fp8.costs import Splits  # noqa: E402
from megalite.fp8.enable import Fp8Settings, enable_fp8  # noqa: E402
from megalite.fp8.linear import Fp8Gemm  # noqa: E402
from megalite.fp8.experts import Fp8Experts  # noqa: E402
from megalite.layers.linear_fn import TakesGemms  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.optim import build_distributed_optimizer  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.perfmodel.estimate import ParamShape, count_params  # noqa: E402
from megalite.perfmodel.flops import model_flops_per_token, peak_flops  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

RECIPES = ("none", "tensorwise", "rowwise")


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_gemms(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    m = 64 if smoke else 8192  # tokens: micro-batch 4 x seq 2048
    shapes = [(64, 64)] if smoke else [(512, 512), (1024, 1024), (2048, 2048), (2048, 3072),
                                                   (2048, 16384), (8192, 2048), (4096, 4096)]
    rows = []
    for k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        qx, qw = x.to(smm.E4M3), w.to(smm.E4M3)  # type: ignore[arg-type]
        one = torch.ones((), device=device)
        ra, rb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        reps = 1 if smoke else 10
        row: dict[str, Any] = {"M": m, "K": k, "N": n, "bf16_ms": 1e3 * timed(lambda: x @ w.t(), device, reps)}
        row["fp8_tensorwise_mm_ms"] = 1e3 * timed(lambda: smm.scaled_mm(qx, qw.t(), one, one, torch.bfloat16), device, reps)
        row["fp8_rowwise_mm_ms"] = 1e3 * timed(lambda: smm.scaled_mm(qx, qw.t(), ra, rb, torch.bfloat16), device, reps)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

        def bf16_step() -> None:
            torch.nn.functional.linear(xg, wg).backward(dy)
        row["bf16_linear_fwd_bwd_ms"] = 1e3 * timed(bf16_step, device, reps)
        for recipe in RECIPES[1:]:
            gemm = Fp8Gemm(recipe, Splits((), (), ()), ParallelState(device=device))  # type: ignore[arg-type]

            def fp8_step(gemm: Fp8Gemm = gemm) -> None:
                gemm.linear(xg, wg).backward(dy)
            row[f"{recipe}_linear_fwd_bwd_ms"] = 1e3 * timed(fp8_step, device, reps)
            row[f"{recipe}_speedup"] = row["bf16_linear_fwd_bwd_ms"] / row[f"{recipe}_linear_fwd_bwd_ms"]
        rows.append(row)
        print(f"gemm {row}", flush=True)
    return rows


def bench_model(device: torch.device, smoke: bool, mbs: int, steps: int) -> dict[str, Any]:
    preset = dict(PRESETS["llama-1b"])
    if smoke:
        preset.update(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=256, seq_len=64,
                      vocab_size=512)
    cfg = ModelArgs(**preset, kernels="torch")
    state = ParallelState(device=device)
    model = GPT(cfg, state, seed=1234).to(device)
    dtype = torch.bfloat16
    opt = build_distributed_optimizer(model, state, 0, dtype, OptimizerConfig())
    n = count_params(ParamShape(cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                cfg.ffn_hidden_size, cfg.vocab_size, cfg.seq_len, bool(cfg.tie_embeddings)))
    fpt = model_flops_per_token(n, cfg.num_layers, cfg.hidden_size, cfg.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak, fp8_peak = peak_flops(name, "bf16"), peak_flops(name, "fp8")
    tcfg = SimpleNamespace(lr=3e-4, min_lr=3e-4, warmup_steps=0, steps=10**9, clip_grad=1.0)
    toks = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = [(toks[:, :-1].to(device), toks[:, 1:].to(device))]
    rows = []
    for recipe in RECIPES:
        for mod in model.modules():  # back to the run dtype before the next recipe
            if isinstance(mod, TakesGemms):
                mod.set_gemms(None)
            if isinstance(mod, Fp8Experts):
                mod.fp8 = None
        chosen = enable_fp8([model], None if recipe == "none" else Fp8Settings(recipe, 128), state)  # type: ignore[arg-type]
        ctx = StepContext.build(model, state, dtype, tcfg, LossScaler(False))
        dt = timed(lambda: train_step(ctx, opt, batch, 0), device, steps)
        loss = train_step(ctx, opt, batch, 0).loss
        tps = mbs * cfg.seq_len / dt
        rows.append({"recipe": recipe, "fp8_linears": len(chosen), "step_s": dt, "tokens_per_s": tps,
                     "mfu": fpt * tps / peak if peak else None, "mfu_over_fp8_peak": fpt * tps / fp8_peak if fp8_peak else None,
                     "loss": loss})
        print(f"model {rows[-1]}", flush=True)
    return {"params": n, "micro_batch": mbs, "seq_len": cfg.seq_len, "peak_flops": peak, "fp8_peak_flops": fp8_peak,
            "rows": rows}


def to_markdown(res: dict[str, Any]) -> str:
    out = [f"FP8 on {res['device']}{' (SMOKE)' if res['smoke'] else ''}: MFU over the bf16 dense peak", "",
           "| recipe | fp8 linears | tokens/s | MFU | MFU over fp8 peak | loss |", "|---|---|---|---|---|---|"]
    for r in res["model"]["rows"]:
        f = (lambda v: "" if v is None else f"{v:.1%}")
        out.append(f"| {r['recipe']} | {r['fp8_linears']} | {r['tokens_per_s']:.0f} | {f(r['mfu'])} | "
                   f"{f(r['mfu_over_fp8_peak'])} | {r['loss']:.4f} |")
    out += ["", "| M x K x N | bf16 ms | tensorwise mm ms | rowwise mm ms | linear fwd+bwd speedup tensorwise | rowwise |",
            "|---|---|---|---|---|---|"]
    for g in res["gemms"]:
        out.append(f"| {g['M']}x{g['K']}x{g['N']} | {g['bf16_ms']:.3f} | {g['fp8_tensorwise_mm_ms']:.3f} | "
                   f"{g['fp8_rowwise_mm_ms']:.3f} | {g['tensorwise_speedup']:.2f} | {g['rowwise_speedup']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type == "cuda" and torch.cuda.get_device_capability() < smm.MIN_CUDA_CAPABILITY:
        print(f"fp8: skipped, {torch.cuda.get_device_name()} has no FP8 tensor cores")
        return 0
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "smoke": a.smoke, "gemms": bench_gemms(device, a.smoke)}
    res["model"] = {"rows": []}
    write_results(Path(a.out), "fp8_gpu", res, to_markdown)  # the GEMM table survives gpu.sh's timeout in the model part
    res["model"] = bench_model(device, a.smoke, 1 if a.smoke else a.micro_batch, 2 if a.smoke else a.steps)
    write_results(Path(a.out), "fp8_gpu", res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
