"""The gated delta rule's forms as the sequence grows: the recurrent reference, the chunked torch form, the Triton
chunk kernels (CUDA only), and causal full attention (SDPA) of the same heads
and width, forward + backward of one layer's core (no projections). Where the chunked form's time per token stays
flat while attention's grows with the length is the crossover the hybrid models bet on.

    python bench/gdn_forms.py                       # GPU: bf16 inputs, 16 value heads of 128, lengths 1k-32k
    python bench/gdn_forms.py --smoke               # CPU, fp32, tiny: the script runs (no figures to quote)
    python bench/gdn_forms.py --out bench/results   # publish (default runs/bench)
    python bench/gdn_forms.py --cpu --machine "2-core shared CPU" --out bench/results   # CPU figures: ratios only

On a CPU (`--cpu`, or no GPU) it runs fp32 at `--heads` x `--dim` over `--lengths`; a shared machine's absolute
times mean little, the ratios of forms measured side by side in one run do (`ratios` in the JSON).

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
    for row in rows:  # side by side in one run: what a loaded machine still measures fairly
        row["chunked_over_attention"] = row["chunked_ms"] / row["attention_ms"]
        if "recurrent_ms" in row:
            row["recurrent_over_chunked"] = row["recurrent_ms"] / row["chunked_ms"]
        if "triton_ms" in row:
            row["triton_over_attention"] = row["triton_ms"] / row["attention_ms"]
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "heads": heads, "dim": dim, "chunk": chunk, "rows": rows}


def to_markdown(res: dict[str, Any]) -> str:
    cols = ["recurrent_ms", "chunked_ms", "triton_ms", "attention_ms"]
    ratios = ["recurrent_over_chunked", "chunked_over_attention", "triton_over_attention"]
    where = ", ".join(f"{k} {res[k]}" for k in ("machine", "date") if res.get(k))
    lines = [f"Gated delta rule vs causal attention, forward + backward, {res['heads']} heads of {res['dim']}, "
             f"{res['dtype']}, {res['device']} (chunk {res['chunk']})" + (f"; {where}" if where else ""), ""]
    if res.get("command"):
        lines += [f"`{res['command']}`", ""]
    lines += ["| tokens | " + " | ".join(c[:-3] + " ms" for c in cols) + " | "
              + " | ".join(r.replace("_over_", " / ") for r in ratios) + " |",
              "|---" * (len(cols) + len(ratios) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in cols) + " | "
                     + " | ".join(f"{r[c]:.3g}" if c in r else "-" for c in ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in fp32: check the script runs")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="where the .json and .md go")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is")
    p.add_argument("--lengths", type=int, nargs="+", help="CPU: sequence lengths (default 256 512 1024 2048)")
    p.add_argument("--heads", type=int, default=2, help="CPU: value (and attention) heads")
    p.add_argument("--dim", type=int, default=16, help="CPU: head width (K = V = the attention's head_dim)")
    p.add_argument("--chunk", type=int, default=16, help="CPU: the chunked form's chunk (the model's: 64)")
    p.add_argument("--recurrent-max", type=int, default=512, help="CPU: the longest sequence the reference runs")
    p.add_argument("--machine", help="recorded with the figures (e.g. '2-core shared CPU')")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke and not a.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        res = measure([1024, 2048, 4096, 8192, 16384, 32768], 16, 128, torch.bfloat16, device, a.repeats, 64, 2048)
    else:
        lengths = [32, 64] if a.smoke else a.lengths or [256, 512, 1024, 2048]
        res = measure(lengths, a.heads, a.dim, torch.float32, device, 1 if a.smoke else a.repeats, a.chunk,
                      a.recurrent_max)
    res.update(machine=a.machine, date=time.strftime("%Y-%m-%d", time.gmtime()),
               command="python bench/gdn_forms.py " + " ".join(sys.argv[1:] if argv is None else argv))
    write_results(a.out, "gdn_forms" + ("_smoke" if a.smoke else "" if cuda else "_cpu"), res, to_markdown)


if __name__ == "__main__":
    main()
