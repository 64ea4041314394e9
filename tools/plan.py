"""Rank the parallel layouts of a model on a cluster by predicted step time, under the memory limit.

    python tools/plan.py --preset gpt3-175b --nodes 128 --gpus-per-node 8 --gpu-memory-gb 80 \\
        --global-batch-size 1536 --inter-gbps 200 --device H100
    python tools/plan.py --preset llama-1b --nodes 1 --gpus-per-node 8 --global-batch-size 256 --json
    python tools/plan.py --num-layers 32 --hidden-size 4096 --num-heads 32 --vocab-size 32000 \\
        --seq-len 4096 --nodes 4 --gpus-per-node 8 --global-batch-size 1024 --top 5
    python tools/plan.py --preset llama-7b --seq-len 131072 --nodes 4 --global-batch-size 16 --cp 1,2,4,8

The arithmetic lives in `megalite.perfmodel.plan` (enumeration) and `megalite.perfmodel.estimate` (the cost of one
layout); this file only parses and prints. Exit code 2 with one line when nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.errors import ConfigError, MegaliteError, entry_point, report  # noqa: E402
from megalite.perfmodel.cp_plan import rank_cp_modes  # noqa: E402
from megalite.perfmodel.estimate import GB, ModelDims, Precision  # noqa: E402
from megalite.perfmodel.flops import normalize_dtype, peak_flops  # noqa: E402
from megalite.perfmodel.compare import PUBLISHED, compare  # noqa: E402
from megalite.perfmodel.plan import Cluster, Plan, Search, make_plan  # noqa: E402
from megalite.perfmodel.moe import moe_preset_model  # noqa: E402
from megalite.perfmodel.moe_plan import make_moe_plan, render_moe  # noqa: E402
from tools.estimate import (OneLineParser, add_model_args, check_dims, estimate_only_note, fraction,  # noqa: E402
                            mla_from_flags, positive_float, positive_int, presets)  # (model flags, sizes, checks shared)

_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
         "seq_len", "head_dim", "mtp_layers")


DEFAULT_SCHEDULES = "1f1b,interleaved"  # what the dense planner tries unless --schedules says otherwise


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="The planner, its ranking rules and a worked --compare: docs/estimator.md")
    m = add_model_args(ap)
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="training dtype (bf16: 16-bit weights with fp32 master and Adam, 16 B/param)")
    m.add_argument("--memory-layout", choices=["paper", "megalite"], default="paper",
                   help="paper: 2+2+K=12 bytes/param (default); megalite: what pretrain.py allocates, "
                        "fp32 main grads (18 bytes/param in bf16)")
    c = ap.add_argument_group("cluster")
    c.add_argument("--nodes", type=positive_int, default=1)
    c.add_argument("--gpus-per-node", type=positive_int, default=8)
    c.add_argument("--gpu-memory-gb", type=positive_float, default=80.0, help="memory per GPU, GB (1e9 bytes)")
    c.add_argument("--memory-fraction", type=fraction, default=0.9,
                   help="usable share of it (CUDA context, NCCL buffers, fragmentation; default 0.9)")
    c.add_argument("--intra-gbps", type=positive_float, help="intra-node (NVLink) bandwidth per GPU, Gbit/s")
    c.add_argument("--intra-gbytes", type=positive_float, default=450.0,
                   help="the same in GB/s (default 450: H100 NVLink, one direction)")
    c.add_argument("--inter-gbps", type=positive_float, default=400.0,
                   help="inter-node bandwidth per GPU, Gbit/s (default 400: one NDR InfiniBand NIC per GPU)")
    c.add_argument("--inter-gbytes", type=positive_float, help="the same in GB/s (wins over --inter-gbps)")
    c.add_argument("--peak-tflops", type=positive_float, help="dense peak TFLOP/s per GPU (default: --device's)")
    c.add_argument("--device", default="H100", help="GPU name to look the peak up (default H100)")
    c.add_argument("--efficiency", type=fraction, default=1.0,
                   help="share of peak the matmuls reach (1.0: ideal, step times are lower bounds)")
    r = ap.add_argument_group("run and search")
    r.add_argument("--global-batch-size", type=positive_int, required=True, help="sequences per optimizer step")
    r.add_argument("--max-micro-batch", type=positive_int, default=16)
    r.add_argument("--max-vpp", type=positive_int, default=8, help="most virtual stages per rank (interleaved 1F1B)")
    r.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages allowed, comma-separated")
    r.add_argument("--schedules",
                   help="pipeline schedules tried, comma-separated, from 1f1b, interleaved, zb-h1, zbv (the "
                        "zero-bubble ones are priced at equal F/B/W costs, their best case); default "
                        f"{DEFAULT_SCHEDULES} (a MoE model: 1f1b, the only one its planner prices)")
    r.add_argument("--cp", default="auto",
                   help="context-parallel sizes tried, comma-separated (e.g. 1,2,4); auto (default): cp = 1, and "
                        "when no layout fits, the powers of two that split the sequence")
    r.add_argument("--top", type=positive_int, default=10, help="layouts shown")
    r.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE,...",
                   help="explain the ranking against this layout (keys tp cp pp dp zero vpp mbs recompute, the "
                        "rest free; e.g. tp=8,pp=8,recompute=full) or a published one by name: "
                        + ", ".join(f"{k} ({v[0]})" for k, v in PUBLISHED.items()) + "; repeatable")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return ap


def resolve_dims(args: argparse.Namespace) -> ModelDims:
    kw: dict = dict(presets()[args.preset]) if args.preset else {}
    for k in _DIMS + ("arch", "tie_embeddings"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    missing = [k for k in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len") if not kw.get(k)]
    if missing:
        raise ConfigError(f"model dims incomplete, missing {', '.join(missing)}; give --preset or "
                          f"--{missing[0].replace('_', '-')} N ...")
    kw["mla"] = mla_from_flags(args, None)  # multi-head latent attention (docs/mla.md): --kv-lora-rank > 0
    return check_dims(ModelDims(**{k: v for k, v in kw.items() if v is not None}))


def resolve_cluster(args: argparse.Namespace) -> Cluster:
    dtype = normalize_dtype(args.dtype)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(args.device, dtype)
    if not peak:
        raise ConfigError(f"no {dtype} peak known for device {args.device!r}; pass --peak-tflops")
    intra = args.intra_gbps * 1e9 / 8 if args.intra_gbps else args.intra_gbytes * GB
    inter = args.inter_gbytes * GB if args.inter_gbytes else args.inter_gbps * 1e9 / 8
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_bytes=args.gpu_memory_gb * GB,
                   intra_bytes_per_s=intra, inter_bytes_per_s=inter, peak_flops=peak,
                   memory_fraction=args.memory_fraction, efficiency=args.efficiency)


def _zero_stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"--zero-stages {text!r} is invalid; give a comma-separated subset of 0,1,2,3")
    return stages


def _precision(layout: str, dtype: str) -> Precision:
    return Precision.megalite(dtype) if layout == "megalite" else Precision.for_dtype(dtype)


def render(plan: Plan, top: int) -> str:
    d, c = plan.dims, plan.cluster
    out = [f"{d.arch} L={d.num_layers} h={d.hidden_size} heads={d.num_heads} s={d.seq_len}: "
           f"{plan.to_dict(0)['params'] / 1e9:.2f} B parameters; {c.nodes} x {c.gpus_per_node} GPUs, "
           f"{c.memory_limit / GB:.0f} GB usable each, global batch {plan.global_batch_size}",
           f"{plan.considered} layouts sized, {plan.costed} fit and were costed; times assume "
           f"{c.efficiency:.0%} of {c.peak_flops / 1e12:.0f} TFLOP/s, DP traffic overlapped with compute",
           "MFU counts PaLM's 6N + 12·L·H·Q·s (N: every parameter, an untied input embedding too, so it can pass "
           "100%); HFU = MFU x the recompute ratio",
           "",
           f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>5} {'zero':>4} {'vpp':>3} {'mbs':>3} {'M':>5} "
           f"{'recomp':>9} {'step s':>8} {'MFU':>6} {'HFU':>6} {'bubble':>6} {'mem GB':>7} {'states':>7} "
           f"{'rest':>6} {'TP GB':>8} {'CP GB':>7} {'PP GB':>7} {'DP GB':>8}"]
    for i, cand in enumerate(plan.ranked[:top], 1):
        lay, est = cand.layout, cand.est
        cb = est.comm_bytes
        out.append(f"{i:>3} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.dp:>5} {lay.zero:>4} {lay.vpp:>3} "
                   f"{lay.micro_batch_size:>3} {est.num_microbatches:>5} {lay.recompute:>9} "
                   f"{cand.step_seconds:>8.3f} {cand.mfu:>6.1%} {cand.hfu:>6.1%} {est.bubble:>6.1%} "
                   f"{cand.memory / GB:>7.1f} {cand.peak.model_states / GB:>7.1f} "  # the peak (docs/estimator.md)
                   f"{(cand.memory - cand.peak.model_states) / GB:>6.1f} "
                   f"{cb.get('tp', 0.0) / GB:>8.2f} {cb.get('cp', 0.0) / GB:>7.2f} "
                   f"{cand.to_dict()['pp_bytes_with_embedding'] / GB:>7.2f} "
                   f"{cb.get('dp', 0.0) / GB:>8.2f}")
    out += ["", "why: " + plan.why]
    out += ["compare " + c.explanation for c in plan.comparisons]
    return "\n".join(out)


def _schedules(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in ("1f1b", "interleaved", "zb-h1", "zbv")]
    if bad or not names:
        raise ConfigError(f"--schedules {text!r}: choose from 1f1b, interleaved, zb-h1, zbv (comma-separated)")
    return names


def _cp_sizes(text: str) -> tuple[int, ...] | None:
    if text.strip() == "auto":
        return None
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--cp {text!r}: give auto or comma-separated sizes >= 1, e.g. --cp 1,2,4")
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        schedules = _schedules(args.schedules or DEFAULT_SCHEDULES)  # an unknown name is refused for every model
        moe = moe_preset_model(args.preset, vars(args))  # a MoE preset: ep is ranked too (perfmodel.moe_plan)
        if moe is not None:
            ignored = [flag for flag, given in (("--compare", bool(args.compare)), ("--cp", args.cp not in ("auto", "1")),
                                                ("--schedules", args.schedules is not None and schedules != ("1f1b",)))
                       if given]
            if ignored:  # not silently dropped: the MoE search is cp = 1 and has no comparison (docs/moe.md)
                raise ConfigError(f"{' and '.join(ignored)} not supported for a MoE model: its planner searches cp = 1, "
                                  "vpp = 1, 1F1B and has no --compare")
            mplan = make_moe_plan(moe, resolve_cluster(args), args.global_batch_size,
                                  _precision(args.memory_layout, normalize_dtype(args.dtype)), args.max_micro_batch,
                                  _zero_stages(args.zero_stages))
            print(json.dumps(mplan.to_dict(args.top), indent=2) if args.json else render_moe(mplan, args.top))
            return 0
        dims = resolve_dims(args)
        search = Search(args.max_micro_batch, args.max_vpp, _zero_stages(args.zero_stages), schedules,
                        _cp_sizes(args.cp))
        plan = make_plan(dims, resolve_cluster(args), args.global_batch_size,
                         _precision(args.memory_layout, normalize_dtype(args.dtype)), search)
        plan.comparisons.extend(compare(plan, spec) for spec in args.compare)
        if plan.ranked[0].layout.cp > 1:  # the winner's cp mode: ring vs allgather vs a2a vs hybrid, and why
            plan.comparisons.append(rank_cp_modes(dims, plan.ranked[0].layout, plan.cluster, plan.prec))
    except MegaliteError as exc:
        return report(exc)
    if args.json:
        out = plan.to_dict(args.top)
        print(json.dumps(out, indent=2))
    else:
        print(render(plan, args.top))
    if (note := estimate_only_note(args.preset)) is not None:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main)())
