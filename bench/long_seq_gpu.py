"""Long-sequence attention on one GPU, the pieces a cp rank runs: causal attention forward + backward at
S = 8K, 16K, 32K (Llama-2-7B's 32 heads of 128 with 8 kv heads, bf16, one sequence), as the megalite torch op
(SDPA), the Triton flash kernel, and document-masked (documents of S/8 tokens: SDPA under an explicit mask,
which is what `data.document_mask` runs today): milliseconds and peak memory per call. At S = 32K this is also
the a2a form's local work at cp = 4 for a 4x larger head count (the whole sequence for heads/cp). One process:
the cp collectives themselves need several GPUs (bench/cp_memory.py measures them on CPU/gloo).

    python bench/long_seq_gpu.py --out runs/bench          # on a GPU; stops starting sizes after --budget-s
    python bench/long_seq_gpu.py --smoke --out /tmp/x      # anywhere: S = 256, SDPA only, seconds
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.results_io import write_results  # noqa: E402
from megalite.context.documents import document_causal_mask, documents  # noqa: E402
from megalite.model.ops import attention, masked_attention  # noqa: E402


def _time_call(fn: Callable[[], torch.Tensor], grads: list[torch.Tensor], device: torch.device,
               reps: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak bytes above the inputs) of `fn`."""
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        t0 = time.perf_counter()
        out = fn()
        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call compiles / warms up
            times.append((time.perf_counter() - t0) * 1e3)
        for g in grads:
            g.grad = None
    peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else 0
    return sorted(times)[len(times) // 2], float(peak)


def run(a: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, notes, deadline = [], [], time.monotonic() + a.budget_s
    impls: dict[str, Callable] = {"sdpa (megalite torch op)": attention}
    if device.type == "cuda":
        from megalite import kernels

        impls["triton flash"] = kernels.flash_attention
    for seq in a.seqs:
        if time.monotonic() > deadline:
            notes.append(f"S={seq}: skipped, out of time budget")
            continue
        q = torch.randn(1, seq, a.heads, a.head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, seq, a.kv_heads, a.head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        tokens = torch.ones(1, seq, dtype=torch.long, device=device)
        tokens[:, seq // 8 - 1::seq // 8] = 0  # eight documents
        docs = documents(tokens, 0).ids
        keep = document_causal_mask(docs, docs)
        cases = {**{name: (lambda f=f: f(q, k, v)) for name, f in impls.items()},
                 "document-masked sdpa": lambda: masked_attention(q, k, v, keep)}
        for name, fn in cases.items():
            try:
                ms, peak = _time_call(fn, [q, k, v], device, a.reps)
                rows.append({"seq": seq, "impl": name, "ms": ms, "peak_bytes": peak})
            except (RuntimeError, torch.OutOfMemoryError) as e:  # e.g. OOM of the mask's math fallback
                notes.append(f"S={seq} {name}: {str(e).splitlines()[0][:160]}")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
            "shape": f"b=1, {a.heads} heads ({a.kv_heads} kv) of {a.head_dim}, {dtype}", "rows": rows, "notes": notes}


def to_markdown(res: dict) -> str:
    lines = [f"Long-sequence attention, forward + backward, {res['device']}, {res['shape']}; {res['date']}"
             + (" (SMOKE: tiny shapes, not a measurement)" if res["smoke"] else ""), "",
             "| S | implementation | ms (median) | peak memory MiB |", "|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['impl']} | {r['ms']:.2f} | {r['peak_bytes'] / 2**20:.0f} |" for r in res["rows"]]
    return "\n".join(lines + [""] + [f"- {n}" for n in res["notes"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=50.0, help="start no new size after this many seconds")
    p.add_argument("--smoke", action="store_true", help="S = 256, 4 heads (2 kv) of 16, CPU, 1 rep")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    a = p.parse_args(argv)
    if a.smoke:
        a.seqs, a.heads, a.kv_heads, a.head_dim, a.reps = [256], 4, 2, 16, 1
    if min(a.seqs) < 8 or any(s % 8 for s in a.seqs) or a.heads % a.kv_heads:
        p.error("--seqs: multiples of 8 (eight documents); --heads a multiple of --kv-heads")
    write_results(a.out, "long_seq" + ("_smoke" if a.smoke else ""), run(a), to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
