"""megalite's MoE layer beside torchtitan's (`torchtitan.models.common.moe.MoE`, 0.3.0), on CPU, one process.

The peer: torchtitan's token-choice MoE (softmax router, top-k, renormalised weights: megalite's `qwen3`
router with `moe_renorm`), its local token dispatcher (ep = 1) and `GroupedExperts`, which always computes
the experts in bf16 through `torch._grouped_mm` (torch 2.13 has it on CPU). Megatron-core's MoELayer is not
used: its dispatcher and experts assume CUDA.

Checked first, on the same weights (megalite's init copied into torchtitan's w1/w3/w2 and gate):
* routing: every token's k experts identical (both take the top-k of fp32 router scores);
* outputs, the loss sum(y * g) for a fixed random g, and the input gradient: equal to bf16 round-off
  (torchtitan's bf16 experts vs megalite's fp32 ones; relative error below 3e-2, where a wrong expert,
  weight or permutation gives O(1)).
Then timed, forward + backward of the layer, the implementations interleaved and their order rotated per
repeat; the ratio peer / megalite is paired per repeat (min / median / max over repeats). megalite runs at
fp32 and at bf16 (its input, router excepted, and experts in bf16: the peer's expert precision).

    python bench/moe_peers.py              # ~1 minute on 2 cores
    python bench/moe_peers.py --smoke      # seconds: tiny dims, 1 repeat
Writes runs/bench/moe_peers.{json,md}, or into --out DIR (--out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.results_io import spread, write_results  # noqa: E402

from megalite.config.schema import ModelConfig  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.mla.config import MLAConfig  # noqa: E402
from megalite.moe.config import MoEConfig  # noqa: E402
from megalite.mtp.config import MTPConfig  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402

BF16_RTOL = 3e-2  # bf16 has 8 mantissa bits: ~4e-3 per rounding, a few roundings through two GEMMs + SwiGLU


def megalite_layer(h: int, f: int, experts: int, k: int, seq: int) -> nn.Module:
    cfg = SimpleNamespace(arch="llama", num_layers=1, hidden_size=h, num_heads=4, num_kv_heads=4,
                          ffn_hidden_size=f, seq_len=seq, vocab_size=64, make_vocab_divisible_by=1, norm_eps=1e-5,
                          rope_theta=10000.0, dropout=0.0, tie_embeddings=False, init_std=0.02, kernels="torch",
                          recompute="none", qk_norm=False, head_dim=0,
                          moe=MoEConfig(experts=experts, top_k=k, ffn_hidden_size=f, router="qwen3", bias_rate=0.0),
                          mla=MLAConfig(), mtp=MTPConfig(),
                          **{k: v for k, v in vars(ModelConfig()).items() if k.startswith("rope_") and k != "rope_theta"})
    return GPT(cfg, ParallelState(), seed=7).layers["0"].mlp


def titan_layer(ours: nn.Module, h: int, f: int, experts: int, k: int) -> nn.Module:
    """torchtitan's MoE with megalite's weights: up = [gate; up] -> w1 (gate), w3 (up); down -> w2."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = MoE.Config(
        num_experts=experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=h, hidden_dim=f, num_experts=experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=experts, gate=Linear.Config(in_features=h, out_features=experts,
                                                                                    bias=False),
                                            top_k=k, score_func="softmax", route_norm=True))
    peer = cfg.build()
    with torch.no_grad():
        inner = peer.routed_experts.inner_experts
        inner.w1_EFD.copy_(ours.experts.up[:, :f])
        inner.w3_EFD.copy_(ours.experts.up[:, f:])
        inner.w2_EDF.copy_(ours.experts.down)
        peer.router.gate.weight.copy_(ours.router.weight)
    return peer


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    loss = (y.float() * g).sum()
    loss.backward()
    assert x.grad is not None
    return y.detach().float(), loss.detach(), x.grad.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_equal(ours: nn.Module, peer: nn.Module, x: torch.Tensor, g: torch.Tensor, k: int) -> dict[str, float]:
    """Routing identical, outputs / loss / input gradient equal to bf16 round-off (module doc), or raise."""
    with torch.no_grad():
        ours_ids = ours.router(x.reshape(-1, x.shape[-1])).experts.sort(-1).values
        _, peer_ids, _ = peer.router(x, None)
    if not torch.equal(ours_ids, peer_ids.reshape(-1, k).sort(-1).values):
        raise AssertionError("megalite and torchtitan route some token to different experts")
    y1, l1, g1 = _run(ours, x, g)
    y2, l2, g2 = _run(peer, x, g)
    scale = float((y1 * g).abs().sum())  # the loss is a sum of terms of both signs: relative to their size
    errs = {"output": _rel(y2, y1), "loss": abs(float(l2 - l1)) / scale, "input_grad": _rel(g2, g1)}
    for what, err in errs.items():
        if not err < BF16_RTOL:
            raise AssertionError(f"torchtitan's {what} differs from megalite's by {err:.2e} (relative)")
    return errs


def timed(fn: Callable[[], Any], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny dims, one repeat (seconds)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="forward + backward passes per timing")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router autocast on CPU
    torch.manual_seed(0)
    # Mixtral's routing (8 experts, top-2) at small widths; smoke: tiny.
    b, s, h, f, e, k = (2, 16, 32, 64, 4, 2) if args.smoke else (4, 256, 256, 512, 8, 2)
    repeats, steps = (1, 1) if args.smoke else (args.repeats, args.steps)
    ours = megalite_layer(h, f, e, k, s)
    peer = titan_layer(ours, h, f, e, k)
    x, g = torch.randn(b, s, h), torch.randn(b, s, h)
    errors = check_equal(ours, peer, x, g, k)
    ours16 = megalite_layer(h, f, e, k, s)
    impls = {"megalite fp32": (ours, x), "megalite bf16": (ours16, x.bfloat16()),
             "torchtitan (bf16 experts)": (peer, x)}
    for layer, inp in impls.values():  # warm-up
        _run(layer, inp, g)
    times: dict[str, list[float]] = {n: [] for n in impls}
    names = list(impls)
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every repeat
            layer, inp = impls[n]
            times[n].append(timed(lambda: _run(layer, inp, g), steps))
    peer_name = names[-1]
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or platform.system()}",
                    "load_average": list(os.getloadavg()), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "smoke": args.smoke,
                    "dims": dict(batch=b, seq=s, hidden=h, expert_ffn=f, experts=e, top_k=k),
                    "repeats": repeats, "steps": steps},
           "equal": errors,
           "seconds": {n: spread(t) for n, t in times.items()},
           "tokens_per_s": {n: b * s / spread(t)["median"] for n, t in times.items()},
           "ratio_peer_over": {n: spread([p / o for p, o in zip(times[peer_name], times[n])])
                               for n in names[:-1]}}
    write_results(Path(args.out), "moe_peers_smoke" if args.smoke else "moe_peers", res, to_markdown)
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    d = m["dims"]
    lines = [f"MoE layer forward + backward on CPU, {m['date']}, {m['machine']}, load average "
             f"{', '.join(f'{v:.2f}' for v in m['load_average'])}, torch {m['torch']}, {m['threads']} threads; "
             f"{d['batch']} x {d['seq']} tokens, h={d['hidden']}, {d['experts']} experts of width {d['expert_ffn']}, "
             f"top-{d['top_k']}; {m['repeats']} repeats of {m['steps']} passes",
             "", "equal first (torchtitan vs megalite fp32, relative): " +
             ", ".join(f"{k} {v:.1e}" for k, v in res["equal"].items()) + "; routing identical", "",
             "| implementation | median s / pass | tokens/s | torchtitan time / this (paired: min / median / max) |",
             "|---|---|---|---|"]
    for n, t in res["seconds"].items():
        r = res["ratio_peer_over"].get(n)
        ratio = f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}" if r else "1 (the peer)"
        lines.append(f"| {n} | {t['median']:.4f} | {res['tokens_per_s'][n]:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
