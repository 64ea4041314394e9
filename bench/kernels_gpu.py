"""Benchmark each Triton kernel against its plain-torch reference (eager, optionally torch.compile).

For every kernel: forward, backward and total time (median of CUDA-event timings), achieved GB/s
(memory-bound kernels: the bytes a perfect kernel must move) or TFLOP/s (attention), the share of
the device's peak, the speedup over the baselines, and the peak memory of forward+backward.

    python bench/kernels_gpu.py                      # GPU, realistic shapes, bf16
    python bench/kernels_gpu.py --compile --json out.json
    python bench/kernels_gpu.py --smoke              # tiny shapes; CPU ok (kernels only with
                                                     # TRITON_INTERPRET=1, else references only)
Call `run_benchmarks(...)` from another script to get the rows as dicts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import megalite.kernels as K  # noqa: E402

# name fragment -> (peak HBM bandwidth in GB/s, dense bf16 peak in TFLOP/s), from vendor datasheets.
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (4800.0, 989.0), "H100 SXM": (3350.0, 989.0), "H100 80GB HBM3": (3350.0, 989.0),
    "H100 PCIe": (2000.0, 756.0), "H100": (3350.0, 989.0), "A100-SXM4-80GB": (2039.0, 312.0),
    "A100": (1555.0, 312.0), "L40S": (864.0, 362.0), "RTX 4090": (1008.0, 165.0),
}

Fn = Callable[..., Any]


@dataclass
class Case:
    """One benchmark: build inputs, then run kernel and reference on them."""

    name: str
    kernel: Fn
    reference: Fn
    make: Callable[[torch.dtype, torch.device], tuple[list[Any], list[int]]]  # (args, indices needing grad)
    bytes_fwd: int = 0       # minimal HBM traffic (memory-bound kernels)
    bytes_bwd: int = 0
    flops_fwd: float = 0.0   # attention
    flops_bwd: float = 0.0


@dataclass
class Row:
    kernel: str
    impl: str
    fwd_ms: float
    bwd_ms: float
    total_ms: float
    fwd_rate: float | None = None      # GB/s or TFLOP/s
    bwd_rate: float | None = None
    rate_unit: str = "GB/s"
    fwd_pct_peak: float | None = None
    bwd_pct_peak: float | None = None
    speedup: float | None = None       # reference eager total / this total
    peak_mem_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _rand(shape: Sequence[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def build_cases(smoke: bool, dtype: torch.dtype) -> list[Case]:
    e = torch.tensor([], dtype=dtype).element_size()
    N, H = (16, 64) if smoke else (16384, 4096)
    F = 128 if smoke else 14336
    B, S, Hq, Hk, D = (1, 40, 4, 2, 16) if smoke else (2, 4096, 32, 8, 128)
    Bn, Sn = (1, 40) if smoke else (8, 4096)
    NV, V = (16, 131) if smoke else (8192, 128256)
    causal_frac = 0.5 * (1 + 1 / S)  # share of the score matrix under the causal mask
    attn_flops = 4.0 * B * Hq * S * S * D * causal_frac

    def rope_inputs(dt: torch.dtype, dev: torch.device) -> tuple[list[Any], list[int]]:
        ang = torch.rand(Sn, D // 2, device=dev) * 6.28
        return [_rand((Bn, Sn, Hq, D), dt, dev), _rand((Bn, Sn, Hk, D), dt, dev), ang.cos(), ang.sin()], [0, 1]

    def ce_inputs(dt: torch.dtype, dev: torch.device) -> tuple[list[Any], list[int]]:
        return [_rand((NV, V), dt, dev, 3.0), torch.randint(0, V, (NV,), device=dev)], [0]

    rows = N * H
    return [
        Case("rms_norm", K.rms_norm, K.rms_norm_reference,
             lambda dt, dev: ([_rand((N, H), dt, dev), torch.ones(H, device=dev, dtype=dt), 1e-5], [0, 1]),
             2 * rows * e, 3 * rows * e),
        Case("add_rms_norm", K.add_rms_norm, K.add_rms_norm_reference,
             lambda dt, dev: ([_rand((N, H), dt, dev), _rand((N, H), dt, dev), torch.ones(H, device=dev, dtype=dt),
                               1e-5], [0, 1, 2]),
             4 * rows * e, 4 * rows * e),
        Case("layer_norm", K.layer_norm, K.layer_norm_reference,
             lambda dt, dev: ([_rand((N, H), dt, dev), torch.ones(H, device=dev, dtype=dt),
                               torch.zeros(H, device=dev, dtype=dt), 1e-5], [0, 1, 2]),
             2 * rows * e, 3 * rows * e),
        Case("rope", K.apply_rope, K.apply_rope_reference, rope_inputs,
             2 * Bn * Sn * (Hq + Hk) * D * e, 2 * Bn * Sn * (Hq + Hk) * D * e),
        Case("swiglu", K.swiglu, K.swiglu_reference,
             lambda dt, dev: ([_rand((N, F), dt, dev), _rand((N, F), dt, dev)], [0, 1]),
             3 * N * F * e, 5 * N * F * e),
        Case("gelu_tanh", K.gelu_tanh, K.gelu_tanh_reference,
             lambda dt, dev: ([_rand((N, F), dt, dev)], [0]), 2 * N * F * e, 3 * N * F * e),
        # Forward reads the logits and writes the gradient in place; backward rescales it.
        Case("cross_entropy", K.cross_entropy, K.cross_entropy_reference, ce_inputs,
             2 * NV * V * e, 2 * NV * V * e),
        Case("flash_attention", lambda q, k, v: K.flash_attention(q, k, v, True),
             lambda q, k, v: K.flash_attention_reference(q, k, v, True),
             lambda dt, dev: ([_rand((B, S, Hq, D), dt, dev), _rand((B, S, Hk, D), dt, dev),
                               _rand((B, S, Hk, D), dt, dev)], [0, 1, 2]),
             flops_fwd=attn_flops, flops_bwd=2.5 * attn_flops),
    ]


class Timer:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _prepare(case: Case, fn: Fn, dtype: torch.dtype, device: torch.device
             ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward-only, forward+backward) closures on fresh inputs with a fixed random upstream grad."""
    args, grad_idx = case.make(dtype, device)
    for i in grad_idx:
        args[i].requires_grad_(True)
    leaves = [args[i] for i in grad_idx]
    outs = fn(*args)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    grads = [torch.randn_like(o) for o in outs]

    def fwd() -> Any:
        return fn(*args)

    def fwd_bwd() -> Any:
        o = fn(*args)
        o = (o,) if isinstance(o, torch.Tensor) else tuple(o)
        # autograd.grad, not backward(): cross_entropy's gradient *is* the logits buffer, which
        # must not be accumulated into .grad of the same leaf.
        return torch.autograd.grad(o, leaves, grads)

    return fwd, fwd_bwd


def _peak_mem_mb(fwd_bwd: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def device_peaks(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, peaks in DEVICE_PEAKS.items():
        if key in name:
            return peaks
    return None, None


def _measure(case: Case, impl: str, fn: Fn, dtype: torch.dtype, device: torch.device, timer: Timer,
             peaks: tuple[float | None, float | None]) -> Row:
    fwd, fwd_bwd = _prepare(case, fn, dtype, device)
    t_fwd = timer(fwd)
    t_total = timer(fwd_bwd)
    # Backward is timed as (forward + backward) - forward; below 2% of the total that difference
    # is timing noise (cross_entropy does nearly all its work in forward), so no rate is reported.
    t_bwd = max(t_total - t_fwd, 0.0)
    bwd_ok = t_bwd > 0.02 * t_total
    row = Row(case.name, impl, t_fwd, t_bwd, t_total, peak_mem_mb=_peak_mem_mb(fwd_bwd, device))
    if case.flops_fwd:
        row.rate_unit, peak = "TFLOP/s", peaks[1]
        row.fwd_rate = case.flops_fwd / t_fwd / 1e9
        row.bwd_rate = case.flops_bwd / t_bwd / 1e9 if bwd_ok else None
    else:
        peak = peaks[0]
        row.fwd_rate = case.bytes_fwd / t_fwd / 1e6
        row.bwd_rate = case.bytes_bwd / t_bwd / 1e6 if bwd_ok else None
    if peak:
        row.fwd_pct_peak = 100 * row.fwd_rate / peak
        row.bwd_pct_peak = 100 * row.bwd_rate / peak if row.bwd_rate is not None else None
    return row


def run_benchmarks(smoke: bool = False, use_compile: bool = False, dtype: torch.dtype = torch.bfloat16,
                   only: Sequence[str] = ()) -> list[Row]:
    """Benchmark rows for every case: the Triton kernel (if it can run here), eager and compiled torch."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_kernels = K.available()  # a CUDA device, or TRITON_INTERPRET=1 on a CPU
    timer = Timer(device, warmup=1 if smoke else 5, reps=2 if smoke else 20)
    peaks = device_peaks(device)
    rows: list[Row] = []
    for case in build_cases(smoke, dtype):
        if only and case.name not in only:
            continue
        eager = _measure(case, "torch eager", case.reference, dtype, device, timer, peaks)
        case_rows = [eager]
        if use_compile:
            case_rows.append(_measure(case, "torch.compile", torch.compile(case.reference), dtype, device, timer, peaks))
        if run_kernels:
            case_rows.append(_measure(case, "triton", case.kernel, dtype, device, timer, peaks))
        for r in case_rows:
            r.speedup = eager.total_ms / r.total_ms
            if eager.peak_mem_mb is not None and r.peak_mem_mb is not None:
                r.extra["mem_saved_mb"] = eager.peak_mem_mb - r.peak_mem_mb
        rows.extend(case_rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_table(rows: Sequence[Row]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    head = (f"{'kernel':<16} {'impl':<14} {'fwd ms':>9} {'bwd ms':>9} {'fwd rate':>10} {'%peak':>6} "
            f"{'bwd rate':>10} {'%peak':>6} {'unit':>8} {'speedup':>8} {'peak MB':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kernel:<16} {r.impl:<14} {f(r.fwd_ms, '9.3f')} {f(r.bwd_ms, '9.3f')} "
                     f"{f(r.fwd_rate, '10.1f')} {f(r.fwd_pct_peak, '6.1f')} {f(r.bwd_rate, '10.1f')} "
                     f"{f(r.bwd_pct_peak, '6.1f')} {r.rate_unit:>8} {f(r.speedup, '7.2f')}x "
                     f"{f(r.peak_mem_mb, '9.1f')}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of each reference")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--only", nargs="*", default=[], help="kernel names to run (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if not args.smoke and not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device; use --smoke for the tiny CPU run", file=sys.stderr)
        return 2
    rows = run_benchmarks(smoke=args.smoke, use_compile=args.compile, dtype=dtype, only=args.only)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}  dtype: {args.dtype}  triton kernels: {'yes' if any(r.impl == 'triton' for r in rows) else 'no'}")
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "dtype": args.dtype, "rows": [asdict(r) for r in rows]},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
