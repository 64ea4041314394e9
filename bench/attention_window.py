"""A sliding-window attention layer's cost against full causal attention's, as the sequence grows: linear past the
window against quadratic. Counted exactly on a CPU, timed on a GPU when there is one.

Per sequence length S and window W (gpt-oss's 128, Gemma 3's 1024):
- pairs: the (query, key) pairs a layer computes per head, sum_i min(i + 1, W) (megalite/attention/costs.py);
- flash tiles: the (query tile, key tile) pairs the Triton kernels visit per head at their GPU tile sizes (bf16,
  head_dim <= 64: forward 128 x 64, dK/dV and dQ 32 x 128; kernels/flash_attention.py `_config`), forward and
  backward together;
- ring blocks at cp = 8: the zigzag ring's (query chunk, key chunk) pairs computed and skipped over all ranks,
  taken from the ring's own planner (megalite/context/ring.py `plan_step`, no attention run) and checked equal to
  the closed form `ring_blocks_total`;
- measured (CPU, Triton interpreter, 16 x 16 tiles): the kernels' own tile counters at short sequences, checked
  equal to the closed forms: the numbers above are the kernels', not a model of them;
- GPU only: forward + backward milliseconds of the flash kernel, full vs windowed (bf16, batch 1, 8 heads of 64);
  bench/gpu.sh runs it (section 9) on a GPU machine: `OUT=bench/results bash bench/gpu.sh` publishes the table.

    python bench/attention_window.py                       # S 1k .. 128k, W 128 and 1024: seconds
    python bench/attention_window.py --smoke               # two short lengths, one window (the test's run)
Writes runs/bench/attention_window.{json,md}, or into --out DIR (--out bench/results: the published table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.results_io import write_results  # noqa: E402
from megalite.attention.costs import (flash_dkdv_tiles, flash_forward_tiles, ring_blocks_total,  # noqa: E402
                                      visible_pairs)

GPU_TILES = {"fwd": (128, 64), "bwd": (32, 128)}  # kernels/flash_attention.py `_config`, bf16, head_dim <= 64
INTERPRETER_TILE = 16
RING_CP = 8


def flash_tiles(seq: int, window: int | None, fwd: tuple[int, int], bwd: tuple[int, int]) -> int:
    """Tiles the forward, dK/dV and dQ kernels visit per head (the dQ kernel runs with the backward tiles swapped)."""
    return (flash_forward_tiles(seq, *fwd, window) + flash_dkdv_tiles(seq, *bwd, window)
            + flash_forward_tiles(seq, bwd[1], bwd[0], window))


def planned_ring_blocks(seq: int, cp: int, window: int | None) -> tuple[int, int]:
    """(computed, skipped) chunk pairs over every rank and step, from the ring's planner itself."""
    import torch

    from megalite.attention.variant import AttentionVariant
    from megalite.context.group import ContextGroup
    from megalite.context.ring import RingCall, plan_step
    from megalite.parallel.state import ParallelState

    computed = skipped = 0
    for rank in range(cp):
        group = ContextGroup(ParallelState(cp=cp, rank=rank), tuple(range(cp)))
        call = RingCall(group, "torch", None, AttentionVariant(window=window))
        for owner in range(cp):
            _, done, left = plan_step(call, owner, seq // (2 * cp), torch.device("cpu"))
            computed, skipped = computed + done, skipped + left
    return computed, skipped


def measured_tiles(seq: int, window: int | None) -> int:
    """The kernels' own tile counter (Triton interpreter on the CPU: 16 x 16 tiles), forward + backward, 1 head."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from megalite.kernels import testing

    kernels = testing.use_interpreter()
    q, k, v = (torch.randn(1, seq, 1, 16, requires_grad=True) for _ in range(3))
    tiles = torch.zeros(3, dtype=torch.int32)
    kernels.flash_attention(q, k, v, True, None, None, window=window, tiles=tiles).sum().backward()
    return int(tiles.sum())


def gpu_ms(seq: int, window: int | None) -> float | None:
    """Forward + backward of the flash kernel on the GPU, median of 10 after 3 warm-ups (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from megalite import kernels

    q, k, v = (torch.randn(1, seq, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernels.flash_attention(q, k, v, True, None, None, window=window).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run(seqs: list[int], windows: list[int], measure: list[int]) -> dict[str, Any]:
    rows = []
    for seq in seqs:
        full_pairs = visible_pairs(seq)
        full_tiles = flash_tiles(seq, None, GPU_TILES["fwd"], GPU_TILES["bwd"])
        full_ring = ring_blocks_total(seq, RING_CP, None)
        for window in [None] + windows:
            ring = ring_blocks_total(seq, RING_CP, window)
            planned = planned_ring_blocks(seq, RING_CP, window)
            assert planned == (ring.computed, ring.skipped), (seq, window, planned, ring)
            tiles = flash_tiles(seq, window, GPU_TILES["fwd"], GPU_TILES["bwd"])
            rows.append({"seq": seq, "window": window, "pairs": visible_pairs(seq, window),
                         "pairs_vs_full": visible_pairs(seq, window) / full_pairs,
                         "flash_tiles": tiles, "tiles_vs_full": tiles / full_tiles,
                         "ring_blocks_computed": ring.computed, "ring_blocks_skipped": ring.skipped,
                         "ring_vs_full": ring.computed / full_ring.computed, "gpu_ms": gpu_ms(seq, window)})
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "ring_cp": RING_CP,
            "gpu_tiles": GPU_TILES, "rows": rows, "interpreter_checks": interpreter_checks(measure, windows)}


def count_tiles(measure: list[int], windows: list[int]) -> list[dict[str, Any]]:
    """The kernels' tile counters (Triton interpreter) at the `measure` lengths, each checked against the closed form."""
    checks = []
    for seq in measure:
        for window in [None] + [w for w in windows if w < seq]:
            got = measured_tiles(seq, window)
            want = flash_tiles(seq, window, (INTERPRETER_TILE,) * 2, (INTERPRETER_TILE,) * 2)
            assert got == want, (seq, window, got, want)
            checks.append({"seq": seq, "window": window, "tiles_measured": got, "tiles_closed_form": want})
    return checks


def interpreter_checks(measure: list[int], windows: list[int]) -> list[dict[str, Any]]:
    """`count_tiles` here on a CPU; on a GPU machine in a child process with TRITON_INTERPRET=1 and no visible GPU:
    Triton picks interpreter or compiled mode once per process, and the timing above has compiled the kernels."""
    import torch

    if not torch.cuda.is_available():
        return count_tiles(measure, windows)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--count-tiles", "--measure",
                            ",".join(map(str, measure)), "--windows", ",".join(map(str, windows))],
                           env=env, capture_output=True, text=True, check=True)
    return json.loads(child.stdout)


def _n(x: int | None) -> str:
    return "full" if x is None else f"{x:,}"


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"# A sliding-window layer's cost vs full causal attention ({res['date']})", "",
             "Per head and sequence. pairs: sum_i min(i+1, W); flash tiles: forward + dK/dV + dQ at the GPU tile "
             f"sizes {res['gpu_tiles']}; ring blocks: the zigzag ring's chunk pairs at cp = {res['ring_cp']} over all "
             "ranks (computed / skipped by the window), from the ring's planner; x full: the fraction of full "
             "attention's. All exact (megalite/attention/costs.py; the planner and the kernels' counters agree).", "",
             "| S | W | pairs | x full | flash tiles | x full | ring blocks computed | skipped | x full | GPU ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ms = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f}"
        lines.append(f"| {r['seq']:,} | {_n(r['window'])} | {r['pairs']:,} | {r['pairs_vs_full']:.3f} | "
                     f"{r['flash_tiles']:,} | {r['tiles_vs_full']:.3f} | {r['ring_blocks_computed']} | "
                     f"{r['ring_blocks_skipped']} | {r['ring_vs_full']:.3f} | {ms} |")
    lines += ["", "The kernels' own tile counters (Triton interpreter, 16 x 16 tiles, forward + backward) against the "
              "closed form:", "", "| S | W | measured | closed form |", "|---:|---:|---:|---:|"]
    for c in res["interpreter_checks"]:
        lines.append(f"| {c['seq']} | {_n(c['window'])} | {c['tiles_measured']} | {c['tiles_closed_form']} |")
    if all(r["gpu_ms"] is None for r in res["rows"]):
        lines += ["", "No GPU in this run: the GPU ms column is empty (run on a CUDA machine to fill it)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768,65536,131072")
    p.add_argument("--windows", default="128,1024")
    p.add_argument("--measure", default="64,128,256", help="lengths whose tiles the interpreter counts")
    p.add_argument("--smoke", action="store_true", help="S 256 and 512, W 32; the interpreter at S 64")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--count-tiles", action="store_true", help="only the interpreter's tile counts, JSON on stdout "
                   "(how a GPU run gets them: interpreter_checks)")
    a = p.parse_args(argv)
    if a.smoke:
        a.seqs, a.windows, a.measure = "256,512", "32", "64"
    ints = [[int(x) for x in s.split(",") if x] for s in (a.seqs, a.windows, a.measure)]
    if a.count_tiles:
        print(json.dumps(count_tiles(ints[2], ints[1])))
        return 0
    res = run(*ints)
    res["smoke"] = a.smoke
    write_results(a.out, "attention_window_smoke" if a.smoke else "attention_window", res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
