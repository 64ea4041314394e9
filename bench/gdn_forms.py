"""The gated delta rule's forms as the sequence grows: the recurrent reference, the chunked torch form, the Triton
chunk kernels (CUDA only), and causal full attention (SDPA) of the same heads
and width, forward + backward of one layer's core (no projections). Where the chunked form's time per token stays
flat while attention's grows with the length is the crossover the hybrid models bet on.

    python bench/gdn_forms.py                       # GPU: bf16 inputs, 16 value heads of 128, lengths 1k-32k
    python bench/gdn_forms.py --smoke               # CPU, fp32, tiny: the script runs (no figures to quote)
    python bench/gdn_forms.py --out bench/results   # publish (default runs/bench)

The medians of a few repeats, wall time after a synchronize; a form is skipped past the length it is practical
at (the recurrent reference is O(T) Python steps). Not run on a GPU yet: bench/results has no figures from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from bench.results_io import write_results  # noqa: E402
from megalite.recurrent.engine import Backend, gated_delta  # noqa: E402
from megalite.recurrent.recurrence import RuleInputs  # noqa: E402


def _time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (Triton compiles, caches fill)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _linear(backend: Backend, x: list[torch.Tensor], chunk: int) -> Callable[[], Any]:
    def run() -> None:
        xs = [t.detach().requires_grad_(True) for t in x]
        o, _ = gated_delta(RuleInputs(*xs), doc_ids=None, scale=x[0].shape[-1] ** -0.5, backend=backend,
                           chunk_size=chunk)
        o.float().square().mean().backward()
    return run


def _attention(x: list[torch.Tensor]) -> Callable[[], Any]:
    def run() -> None:
        q, k, v = (t.detach().transpose(1, 2).requires_grad_(True) for t in x[:3])
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().mean().backward()
    return run


def measure(lengths: list[int], heads: int, dim: int, dtype: torch.dtype, device: torch.device, repeats: int,
            chunk: int, recurrent_max: int) -> dict[str, Any]:
    rows = []
    for t in lengths:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k = (F.normalize(torch.randn(1, t, heads, dim, generator=gen), dim=-1) for _ in range(2))
        v = torch.randn(1, t, heads, dim, generator=gen)
        g, beta = -torch.rand(1, t, heads, generator=gen) * 0.1, torch.rand(1, t, heads, generator=gen)
        x = [a.to(device=device, dtype=dtype) for a in (q, k, v)] + [g.to(device), beta.to(device)]
        row: dict[str, Any] = {"tokens": t}
        row["chunked_ms"] = 1e3 * _time(_linear("chunked", x, chunk), repeats, device)
        if device.type == "cuda":
            row["triton_ms"] = 1e3 * _time(_linear("triton", x, chunk), repeats, device)
        if t <= recurrent_max:
            row["recurrent_ms"] = 1e3 * _time(_linear("recurrent", x, chunk), repeats, device)
        row["attention_ms"] = 1e3 * _time(_attention(x), repeats, device)
        rows.append(row)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "heads": heads, "dim": dim, "chunk": chunk, "rows": rows}


def to_markdown(res: dict[str, Any]) -> str:
    cols = ["recurrent_ms", "chunked_ms", "triton_ms", "attention_ms"]
    lines = [f"Gated delta rule vs causal attention, forward + backward, {res['heads']} heads of {res['dim']}, "
             f"{res['dtype']}, {res['device']} (chunk {res['chunk']})", "",
             "| tokens | " + " | ".join(c[:-3] + " ms" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in fp32: check the script runs")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="where the .json and .md go")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        res = measure([1024, 2048, 4096, 8192, 16384, 32768], 16, 128, torch.bfloat16, device, a.repeats, 64, 2048)
    else:
        lengths = [32, 64] if a.smoke else [256, 512, 1024, 2048]
        res = measure(lengths, 2, 16, torch.float32, device, 1 if a.smoke else a.repeats, 16, 512)
    write_results(a.out, "gdn_forms" + ("_smoke" if a.smoke else ""), res, to_markdown)


if __name__ == "__main__":
    main()
