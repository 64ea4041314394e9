"""One-GPU benchmark (what `bench/gpu.sh` runs): MFU of a ~1B llama, the kernel table, flash vs SDPA.

Sections, each written to the JSON/markdown as soon as it finishes (so a timeout keeps what ran):

1. model: the `llama-1b` preset (16 layers, h 2048, GQA 32/8, vocab 128256, tied), bf16 compute,
   seq 2048, megalite's real `train_step` and optimizer (fwd + bwd + grad norm + clip + fused AdamW on
   bf16 params with fp32 main grads and master weights, as pretrain.py builds them) at tp=pp=dp=1, with
   `model.kernels=torch` (eager), `triton` (the fused kernels) and `torch` under `torch.compile`.
   tokens/s, MFU = 6N + 12Lhs FLOPs/token (megalite.perfmodel.flops, PaLM appendix B) x tokens/s / dense
   bf16 peak, and peak allocated memory. One model is built and its ops swapped between variants
   (init of 1.2B parameters on the CPU is the slowest part of setup).
2. kernels: `bench/kernels_gpu.py`'s table (each Triton kernel vs eager and compiled torch).
3. attention: `kernels.flash_attention` vs `F.scaled_dot_product_attention` (megalite's torch op,
   SDPA's own GQA, and with kv heads repeated) at the 1B model's shapes: fwd+bwd ms, TFLOP/s, peak memory.

    python bench/gpu_bench.py --out DIR           # H200: < 8 minutes (bash bench/gpu.sh)
    python bench/gpu_bench.py --smoke --out DIR   # CPU, tiny shapes, seconds; CUDA-only parts noted
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from megalite.config import PRESETS, ModelArgs  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.perfmodel.flops import model_flops_per_token, peak_flops  # noqa: E402
from megalite.model.gpt import GPT, count_parameters  # noqa: E402
from megalite.model.ops import attention as sdpa_attention  # noqa: E402
from megalite.model.ops import get_ops  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.optim import build_distributed_optimizer  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402


def attention_repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """megalite's attention with K/V heads repeated before SDPA (the pre-2.5 path): the baseline of the
    flash-vs-SDPA table."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2)


class Report:
    """Accumulates sections and rewrites gpu_bench.{json,md} after each one."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out, self.data = out, {"meta": meta, "sections": {}, "notes": []}
        out.mkdir(parents=True, exist_ok=True)

    def note(self, msg: str) -> None:
        print(f"note: {msg}", flush=True)
        self.data["notes"].append(msg)

    def add(self, name: str, value: Any) -> None:
        self.data["sections"][name] = value
        self.write()

    def write(self) -> None:
        (self.out / "gpu_bench.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out / "gpu_bench.md").write_text(to_markdown(self.data))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def set_ops(model: torch.nn.Module, kind: str) -> None:
    """Swap the op backend of a built model (every module that holds `ops`): the kernels are
    drop-in replacements with the same signatures (megalite.model.ops), so the weights can stay."""
    ops = get_ops(kind)
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops


# ----------------------------------------------------------------------------- 1. the model


def bench_model(rep: Report, smoke: bool, device: torch.device, dtype: torch.dtype, mbs: int, steps: int,
                deadline: float, variants: list[str]) -> None:
    preset = dict(PRESETS["llama-1b"])
    if smoke:
        preset.update(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=64,
                      vocab_size=512)
    cfg = ModelArgs(**{k: v for k, v in preset.items()}, kernels="torch")
    state = ParallelState(device=device)
    t0 = time.perf_counter()
    model = GPT(cfg, state, seed=1234).to(device)
    # pretrain.py's optimizer: params in `dtype`, fp32 main grads (linear weight grads added in place),
    # fp32 master + Adam, torch's fused AdamW on the flat buffers.
    opt = build_distributed_optimizer(model, state, 0, dtype, OptimizerConfig())
    n_params = count_parameters(model, state)
    fpt = model_flops_per_token(n_params, cfg.num_layers, cfg.hidden_size, cfg.seq_len)
    peak = peak_flops(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    setup = {"params": n_params, "flops_per_token": fpt, "peak_flops": peak, "micro_batch": mbs,
             "seq_len": cfg.seq_len, "dtype": str(dtype).removeprefix("torch."), "build_s": time.perf_counter() - t0,
             "preset": "llama-1b" + (" (smoke: shrunk)" if smoke else "")}
    tcfg = SimpleNamespace(lr=3e-4, min_lr=3e-4, warmup_steps=0, steps=10**9, clip_grad=1.0)
    scaler = LossScaler(enabled=False)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_len + 1), generator=g)
    batch = [(toks[:, :-1].to(device), toks[:, 1:].to(device))]
    rows: list[dict[str, Any]] = []
    for variant in variants:
        if time.perf_counter() > deadline:
            rep.note(f"model/{variant}: skipped, out of time budget")
            continue
        if variant == "triton" and not _kernels_available():
            rep.note("model/triton: skipped (needs CUDA, or TRITON_INTERPRET=1 on a CPU)")
            continue
        if variant == "compile" and device.type != "cuda":
            rep.note("model/compile: skipped on CPU (minutes of inductor C++ compilation; GPU only)")
            continue
        try:
            set_ops(model, "triton" if variant == "triton" else "torch")
            run_model = torch.compile(model) if variant == "compile" else model
            reset_peak(device)
            t_warm = time.perf_counter()
            for i in range(2 if smoke else 3):  # compile happens in the first of these
                loss = train_step(StepContext.build(run_model, state, dtype, tcfg, scaler), opt, batch, i).loss
            sync(device)
            warm_s = time.perf_counter() - t_warm
            times = []
            for i in range(steps):
                t = time.perf_counter()
                train_step(StepContext.build(run_model, state, dtype, tcfg, scaler), opt, batch, i)
                sync(device)
                times.append(time.perf_counter() - t)
            dt = statistics.median(times)
            tps = mbs * cfg.seq_len / dt
            rows.append({"variant": variant, "step_s_median": dt, "step_s_min": min(times), "tokens_per_s": tps,
                         "tflops": fpt * tps / 1e12, "mfu": fpt * tps / peak if peak else None,
                         "peak_mem_gib": peak_gib(device), "warmup_s": warm_s, "loss": loss})
            print(f"model/{variant}: {rows[-1]}", flush=True)
        except Exception as e:  # a broken variant must not cost the others
            rep.note(f"model/{variant}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            traceback.print_exc()
        rep.add("model", {"setup": setup, "rows": rows})
    set_ops(model, "torch")
    del model, opt
    rep.add("model", {"setup": setup, "rows": rows})


def _kernels_available() -> bool:
    try:
        from megalite import kernels
    except ImportError:
        return False
    return kernels.available()


# ----------------------------------------------------------------------------- 2. the kernel table


def bench_kernels(rep: Report, smoke: bool, deadline: float) -> None:
    if not (REPO / "bench" / "kernels_gpu.py").exists():
        rep.note("kernels: bench/kernels_gpu.py does not exist yet: no kernel table")
        return
    import bench.kernels_gpu as kg

    left = deadline - time.perf_counter()
    use_compile = not smoke and left > 180  # compiling 8 references takes a minute or two
    if not smoke and not use_compile:
        rep.note(f"kernels: only {left:.0f}s left, torch.compile column skipped")
    if left < 30:
        rep.note("kernels: skipped, out of time budget")
        return
    if not _kernels_available():
        rep.note("kernels: Triton kernels cannot run here (no CUDA, TRITON_INTERPRET unset): references only")
    rows = kg.run_benchmarks(smoke=smoke, use_compile=use_compile, dtype=torch.float32 if smoke else torch.bfloat16)
    rep.add("kernels", {"rows": [vars(r) for r in rows], "table": kg.format_table(rows)})


# ----------------------------------------------------------------------------- 3. flash vs SDPA


def bench_attention(rep: Report, smoke: bool, device: torch.device, dtype: torch.dtype, mbs: int) -> None:
    b, s, hq, hk, d = (1, 64, 4, 2, 16) if smoke else (mbs, 2048, 32, 8, 64)  # the 1B model's shapes
    flops_fwd = 4.0 * b * hq * s * s * d * 0.5  # causal: half the score matrix
    impls: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa kv repeated": attention_repeat_kv,
        "sdpa enable_gqa (megalite torch op)": sdpa_attention,
    }
    if _kernels_available():
        from megalite import kernels

        impls["triton flash_attention"] = kernels.flash_attention
    else:
        rep.note("attention: triton flash_attention skipped (needs CUDA or TRITON_INTERPRET=1)")
    rows = []
    for name, fn in impls.items():
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for h in (hq, hk, hk))
        go = torch.randn(b, s, hq, d, device=device, dtype=dtype)

        def fwd_bwd() -> None:
            torch.autograd.grad(fn(q, k, v), (q, k, v), go)

        try:
            for _ in range(1 if smoke else 3):
                fwd_bwd()
            reset_peak(device)
            times = []
            for _ in range(2 if smoke else 10):
                sync(device)
                t = time.perf_counter()
                fwd_bwd()
                sync(device)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            rows.append({"impl": name, "fwd_bwd_ms": ms, "tflops": 3.5 * flops_fwd / (ms / 1e3) / 1e12,
                         "peak_mem_gib": peak_gib(device)})
        except Exception as e:
            rep.note(f"attention/{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    rep.add("attention", {"shape": {"b": b, "s": s, "hq": hq, "hk": hk, "d": d}, "rows": rows,
                          "flops_note": "fwd 4bhs^2d/2 (causal), bwd 2.5x fwd: total 3.5x fwd"})


# ----------------------------------------------------------------------------- output


def _f(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def to_markdown(data: dict[str, Any]) -> str:
    m, sec = data["meta"], data["sections"]
    smoke = " (SMOKE: CPU, tiny shapes)" if m["smoke"] else ""
    lines = [f"GPU benchmark: {m['device']}, torch {m['torch']}, {m['date']}{smoke}",
             ""]
    if "model" in sec:
        st = sec["model"]["setup"]
        lines += [f"Model: {st['preset']}, {st['params'] / 1e9:.3f}B params, seq {st['seq_len']}, micro-batch "
                  f"{st['micro_batch']}, {st['dtype']}; peak {_f(st['peak_flops'] and st['peak_flops'] / 1e12, '.0f')} "
                  "TFLOP/s dense.", "", "| variant | step s | tokens/s | TFLOP/s | MFU | peak mem GiB |",
                  "|---|---|---|---|---|---|"]
        for r in sec["model"]["rows"]:
            lines.append(f"| {r['variant']} | {r['step_s_median']:.3f} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | "
                         f"{_f(r['mfu'] and 100 * r['mfu'], '.1f%')} | {_f(r['peak_mem_gib'], '.1f')} |")
        lines.append("")
    if "attention" in sec:
        a = sec["attention"]["shape"]
        lines += [f"Attention fwd+bwd, b {a['b']}, s {a['s']}, {a['hq']}/{a['hk']} heads, d {a['d']}:", "",
                  "| impl | ms | TFLOP/s | peak mem GiB |", "|---|---|---|---|"]
        lines += [f"| {r['impl']} | {r['fwd_bwd_ms']:.3f} | {r['tflops']:.1f} | {_f(r['peak_mem_gib'], '.2f')} |"
                  for r in sec["attention"]["rows"]]
        lines.append("")
    if "kernels" in sec:
        lines += ["Kernels (bench/kernels_gpu.py):", "", "```", sec["kernels"]["table"], "```", ""]
    lines += [f"- note: {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                  help="output directory (default runs/bench, untracked; bench/results: the published figures)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences of 2048 tokens per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model variant")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining sections after this")
    p.add_argument("--variants", nargs="*", default=["torch", "triton", "compile"])
    a = p.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not a.smoke:
        print("gpu_bench: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU smoke: fp32 (bf16 CPU matmuls are slow)
    if a.smoke:
        a.steps, a.micro_batch = 2, 2
    meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "smoke": a.smoke, "argv": sys.argv[1:]}
    rep = Report(a.out, meta)
    deadline = start + a.budget_s
    bench_model(rep, a.smoke, device, dtype, a.micro_batch, a.steps, deadline - 150, a.variants)
    bench_attention(rep, a.smoke, device, dtype, a.micro_batch)
    bench_kernels(rep, a.smoke, deadline)
    rep.data["meta"]["wall_s"] = time.perf_counter() - start
    rep.write()
    print(to_markdown(rep.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
