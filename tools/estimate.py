"""Predict memory, communication, FLOPs and step time of a megalite run before spending GPU time.

    python tools/estimate.py --preset llama-7b --tp 2 --pp 4 --dp 8 --sp --zero 1 \\
        --global-batch-size 512 --bandwidth-gbps 200 --intra-bandwidth-gbytes 450 --device H100
    python tools/estimate.py --params 7e9 --dp 64 --bandwidth-gbytes 3.1      # 7B on 64 ranks at 25 Gb/s
    python tools/estimate.py --config configs/x.toml --parallel.tp 2 --dp 64 --json
    python tools/estimate.py --largest-model --gpu-memory-gb 32 --dp 64 --zero 2   # ZeRO paper, Table 2
    python tools/estimate.py --params 175e9 --dp 1024 --train-tokens 300e9 --achieved-tflops 140   # days
    python tools/estimate.py --preset llama-7b --dp 8 --memory-layout megalite     # what pretrain.py allocates
    python tools/estimate.py --preset llama-7b --seq-len 32768 --tp 8 --sp --cp 4   # context parallel (--parallel.cp)

Every mode is described, with a worked example, in docs/estimator.md.

The arithmetic lives in `megalite.perfmodel.estimate` (pure functions); this file only parses and prints.
With `--config`, the model/parallel/train sections of a pretrain config (and its `--section.field`
overrides) are read through `megalite.config.parse_args`; explicit flags here still win.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import dataclasses
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.errors import ConfigError, MegaliteError, entry_point, report  # noqa: E402
from megalite.fp8.costs import FP8_CHOICES  # noqa: E402
from megalite.mla.costs import MLADims  # noqa: E402
from megalite.optim.config import MAX_NS_STEPS  # noqa: E402
from megalite.perfmodel.config_inputs import (FEATURE_DEFAULTS, MODEL_FLAGS, from_config,  # noqa: E402
                                             presets)  # (presets: shared with tools/plan.py)
from megalite.perfmodel.moe import moe_report  # noqa: E402
from megalite.perfmodel.muon import muon_report  # noqa: E402
from megalite.perfmodel.report import peak_of, render  # noqa: E402
from megalite.perfmodel.estimate import (GB, Estimate, Hardware, Layout, ModelDims, Precision,  # noqa: E402
                                         estimate)
from megalite.perfmodel.flops import HFU_CONVENTIONS, normalize_dtype, peak_flops  # noqa: E402
from megalite.perfmodel.schedules import SCHEDULES  # noqa: E402
from megalite.perfmodel.questions import (DAY, Throughput, largest_num_layers, largest_params,  # noqa: E402
                                          training_time, utilizations)

_MODEL_HELP = {"head_dim": "attention head dimension Q (default hidden/heads); PaLM's MFU counts 12·L·H·Q·s for attention",
               "mtp_layers": "multi-token prediction depth D (the config's mtp.num_layers; docs/mtp.md): D more blocks "
                             "and logits on the last stage"}
_LAYOUT_FLAGS = ("tp", "pp", "dp", "zero", "vpp", "schedule", "micro_batch_size", "global_batch_size",
                 "recompute", "cp", "cp_mode", "cp_a2a")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is one line on stderr and exit 2 (as a ConfigError)."""

    def error(self, message: str) -> NoReturn:
        self.exit(ConfigError.exit_code, f"error: {message}; see --help\n")


def _number(kind: type, low: float, low_ok: bool, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite `kind` number above `low` (or equal when `low_ok`), at most `high`."""
    def parse(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        ok = math.isfinite(number) and (number > low or (low_ok and number == low))
        ok = ok and (high is None or number <= high) and (kind is not int or number.is_integer())
        if not ok:
            what = "an integer" if kind is int else "a number"
            bound = (f">= {low}" if low_ok else f"> {low}") + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return kind(number)
    return parse


positive_int = _number(int, 0, False)
positive_float = _number(float, 0.0, False)
fraction = _number(float, 0.0, False, 1.0)


def estimate_only_presets() -> list[str]:
    """The presets this tool and tools/plan.py know but pretrain.py's `--model.preset` does not."""
    from megalite.config import PRESETS as RUNNABLE

    return sorted(set(presets()) - set(RUNNABLE))


def estimate_only_note(preset: str | None) -> str | None:
    """One line for a preset pretrain.py would refuse: the estimate stands, the run needs the dims spelled out."""
    if preset is None or preset not in estimate_only_presets():
        return None
    return (f"note: --preset {preset} is estimate-only: pretrain.py has no such preset (its presets: "
            "python pretrain.py --help); train this shape with --model.num_layers/--model.hidden_size/... flags")


def add_model_args(ap: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model flags shared with tools/plan.py: a preset and/or explicit dims."""
    m = ap.add_argument_group("model (a preset, explicit dims, or both: flags override the preset)")
    m.add_argument("--preset", choices=sorted(presets()), metavar="NAME",
                   help=f"{', '.join(sorted(presets()))} ({', '.join(estimate_only_presets())}: estimate-only, "
                        "published shapes pretrain.py has no preset for; give it their dims as --model.* flags)")
    m.add_argument("--arch", choices=["llama", "gpt2"])
    for name in MODEL_FLAGS[1:]:
        m.add_argument("--" + name.replace("_", "-"), type=positive_int,
                       help=_MODEL_HELP.get(name))
    m.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    for name, default in MLA_FLAGS.items():  # multi-head latent attention (docs/mla.md): on with --kv-lora-rank
        m.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"MLA's {name} (the [mla] section; default {default})" if name != "kv_lora_rank"
                       else "MLA: the compressed KV width; > 0 prices multi-head latent attention (docs/mla.md)")
    return m


MLA_FLAGS: dict[str, int] = {f.name: f.default if isinstance(f.default, int) else 0  # kv_lora_rank: none
                             for f in dataclasses.fields(MLADims)}


def mla_from_flags(args: argparse.Namespace, given: MLADims | None) -> MLADims | None:
    """MLA's widths: the config's (`given`) with the MLA flags set over them; None when MLA stays off."""
    base = dataclasses.asdict(given) if given is not None else dict(MLA_FLAGS, kv_lora_rank=0)
    widths = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.items()}
    if min(widths.values()) < 0:  # --kv-lora-rank -1 is no "off": refused as pretrain.py's mla.kv_lora_rank is
        raise ConfigError(f"MLA widths {widths}: each must be >= 1 (q_lora_rank >= 0; kv_lora_rank 0 = MLA off)")
    if widths["kv_lora_rank"] == 0:
        return None
    if min(v for k, v in widths.items() if k != "q_lora_rank") < 1:
        raise ConfigError(f"MLA widths {widths}: each must be >= 1 (q_lora_rank >= 0)")
    return MLADims(**widths)


def check_config_model(config_argv: list[str]) -> None:
    """A pretrain config's model sections against pretrain.py's rules (`model_problems`), before any figure: what
    the dims below do not carry (the RoPE scaling) is checked too."""
    from megalite.config import parse_args
    from megalite.config.validate import model_problems

    cfg = parse_args(config_argv)
    _refuse_model(model_problems(cfg.model, cfg.moe, cfg.mla, cfg.mtp))


def _refuse_model(problems: list[str]) -> None:
    if problems:
        raise ConfigError(f"pretrain.py would refuse this model: {'; '.join(problems)}")


def check_dims(dims: ModelDims) -> ModelDims:
    """`dims` if pretrain.py would build that model, else one ConfigError naming each rule it breaks: the same
    function a run's config and a checkpoint's index.json are checked with (`megalite.config.validate.
    model_problems`), so neither tool prices a model the run refuses."""
    from megalite.config.schema import ModelConfig
    from megalite.config.validate import model_problems
    from megalite.mla.config import MLAConfig
    from megalite.moe.config import MoEConfig
    from megalite.mtp.config import MTPConfig

    model = ModelConfig(arch=dims.arch, num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                        num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads or 0,
                        ffn_hidden_size=dims.ffn_hidden_size or 0, vocab_size=dims.vocab_size, seq_len=dims.seq_len,
                        tie_embeddings=dims.tie_embeddings, head_dim=dims.head_dim or 0)
    mla = MLAConfig(**dataclasses.asdict(dims.mla)) if dims.mla is not None else MLAConfig()
    _refuse_model(model_problems(model, MoEConfig(), mla, MTPConfig(num_layers=dims.mtp_layers)))
    return dims


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Modes and worked examples: docs/estimator.md")
    m = add_model_args(ap)
    m.add_argument("--params", type=positive_float, help="override the parameter count (e.g. 7e9)")
    p = ap.add_argument_group("layout")
    for name in ("tp", "pp", "dp", "vpp", "micro_batch_size", "global_batch_size"):
        p.add_argument("--" + name.replace("_", "-"), type=positive_int)
    p.add_argument("--cp", type=positive_int,
                   help="context parallel size (also --parallel.cp): each sequence split over cp ranks, ring "
                        "attention; devices = tp x cp x pp x dp")
    p.add_argument("--ep", type=positive_int, help="expert parallel size for a MoE model (experts split over ep of "
                   "the dp x cp ranks; default: the config's parallel.ep, else 1)")
    p.add_argument("--moe-load-imbalance", type=positive_float, help="a measured max/mean tokens per expert "
                   "(metrics.jsonl moe.load_max / load_mean): what it costs the busiest ep rank")
    p.add_argument("--cp-mode", choices=["ring", "allgather", "a2a", "hybrid"],
                   help="context-parallel attention (also --parallel.cp_mode): ring (default) | allgather | a2a | "
                        "hybrid")
    p.add_argument("--cp-a2a", type=positive_int,
                   help="cp_mode=hybrid: cp ranks per all-to-all group (also --parallel.cp_a2a; divides cp)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--schedule", choices=list(SCHEDULES),
                   help="pipeline schedule (zb-h1, zbv: Qi et al. 2024, priced at equal F/B/W costs)")
    p.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="selective recomputes the attention core (+4·L·H·Q·s FLOPs/token), full the "
                        "layers' forward (+2·layer weights + 4·L·H·Q·s); both priced in FLOPs, HFU and time")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="training dtype (default bf16)")
    p.add_argument("--memory-layout", choices=["paper", "megalite"],
                   help="paper: the ZeRO paper's 2+2+K=12 bytes/param (default); megalite: what pretrain.py "
                        "allocates, 16-bit params + fp32 main grads + fp32 master + Adam = 18 bytes/param "
                        "(16 in fp32), grads reduced in fp32 (default with --config)")
    p.add_argument("--memory-device", choices=["cuda", "cpu"], default="cuda",
                   help="the peak-memory model's device: its baseline (CUDA context / interpreter + torch) and slack")
    p.add_argument("--param-dtype", choices=["bf16", "fp16", "fp32"],
                   help="(paper layout) dtype weights and grads are stored in (default: --dtype, with fp32 "
                        "master weights; fp32: 4+4+0+8 bytes/param)")
    p.add_argument("--grad-reduce-dtype", choices=["bf16", "fp16", "fp32"],
                   help="dtype gradients are communicated in (default: the training dtype)")
    h = ap.add_argument_group("hardware")
    h.add_argument("--bandwidth-gbps", type=positive_float, help="inter-node bandwidth in Gbit/s (DP, PP)")
    h.add_argument("--bandwidth-gbytes", type=positive_float, help="inter-node bandwidth in GB/s")
    h.add_argument("--intra-bandwidth-gbytes", type=positive_float,
                   help="intra-node (NVLink) bandwidth in GB/s for TP (default: the inter-node one)")
    h.add_argument("--peak-tflops", type=positive_float, help="dense peak TFLOP/s per device")
    h.add_argument("--device", help="device name to look the peak up, e.g. 'NVIDIA H100 80GB HBM3'")
    h.add_argument("--fp8", choices=list(FP8_CHOICES),
                   help="fp8.recipe: the filtered block GEMMs at the device's dense FP8 peak, plus their amax "
                        "all-reduces and scale tensors (docs/fp8.md; a MoE preset's expert GEMMs: its MoE section); "
                        "MFU: bf16 peak (default: the config's fp8.recipe, else none)")
    h.add_argument("--optimizer", choices=["adamw", "muon"],
                   help="optimizer.name: muon adds its Newton-Schulz FLOPs and 'muon' bytes (docs/muon.md) "
                        "(default: the config's optimizer.name, else adamw)")
    h.add_argument("--fp8-min-dim", type=positive_int, help="fp8.min_dim (the FP8 filter; default: the config's, "
                   "else 128)")
    h.add_argument("--muon-ns-steps", type=_number(int, 1, True, MAX_NS_STEPS),
                   help="muon.ns_steps, the Newton-Schulz steps priced (default: the config's, else 5)")
    h.add_argument("--hfu-convention", choices=list(HFU_CONVENTIONS), default="executed",
                   help="selective recompute's HFU: executed (the re-run attention core, default) or korthikanti "
                        "(Korthikanti et al. 2022 Table 5's 72BLsh^2(1 + s/3h + V/12hL))")
    h.add_argument("--efficiency", type=fraction, default=1.0,
                   help="fraction of peak the matmuls reach (1.0 = ideal lower bound on time)")
    q = ap.add_argument_group("questions (docs/estimator.md has a worked example of each)")
    q.add_argument("--largest-model", action="store_true",
                   help="the largest model that fits in --gpu-memory-gb: from model states alone (ZeRO paper, "
                        "Table 2), or, with a model shape, its most layers whose states and activations fit")
    q.add_argument("--gpu-memory-gb", type=positive_float, help="memory per device, GB (1e9 bytes)")
    q.add_argument("--memory-fraction", type=fraction, default=1.0,
                   help="usable share of --gpu-memory-gb (default 1.0, as the ZeRO paper)")
    q.add_argument("--train-tokens", type=positive_float,
                   help="how long training on this many tokens takes, in days (with --achieved-tflops, "
                        "--mfu, or a peak for the predicted step time); devices = tp x pp x dp")
    q.add_argument("--achieved-tflops", type=positive_float,
                   help="achieved hardware TFLOP/s per device, counted as Megatron does (recompute included)")
    q.add_argument("--mfu", type=fraction, help="achieved model FLOPs utilization, e.g. 0.45 (needs a peak)")
    q.add_argument("--step-seconds", type=positive_float,
                   help="a measured step time: report its MFU and HFU (Korthikanti et al. 2022, Table 5)")
    ap.add_argument("--config", help="a pretrain TOML config (needs megalite.config)")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return ap


def _split_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Send `--config FILE` and dotted `--section.field VALUE` overrides to the config parser."""
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key = arg.split("=", 1)[0]
        if key == "--config" or (key.startswith("--") and "." in key):
            theirs.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                theirs.append(argv[i + 1])
                i += 1
        else:
            ours.append(arg)
        i += 1
    return ours, theirs


def resolve(args: argparse.Namespace, config_argv: list[str]) -> dict:
    """Turn flags (+ optional config) into the keyword arguments of `megalite.perfmodel.estimate.estimate`.
    The feature flags left unset (`--fp8`, `--optimizer`, ...) are filled in `args` from the config, else their
    defaults, so every report below prices what the config would run."""
    dims_kw: dict = {}
    lay_kw: dict = {}
    dtype = None
    features: dict = {}
    if config_argv:
        check_config_model(config_argv)
        dims_kw, lay_kw, dtype, features = from_config(config_argv)
    for key, default in FEATURE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, features.get(key, default))
    if args.preset:  # an explicit flag: wins over a config's model too (`--preset X --parallel.cp 2`)
        dims_kw = dict(presets()[args.preset])
    for k in MODEL_FLAGS + ("tie_embeddings",):
        if getattr(args, k) is not None:
            dims_kw[k] = getattr(args, k)
    for k in _LAYOUT_FLAGS + ("sp",):
        if getattr(args, k) is not None:
            lay_kw[k] = getattr(args, k)
    dims_kw["mla"] = mla_from_flags(args, dims_kw.get("mla"))
    dims = None
    required = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len")
    if any(dims_kw.get(k) for k in required):
        missing = [k for k in required if not dims_kw.get(k)]
        if missing:
            raise ConfigError(f"model dims incomplete, missing {', '.join(missing)}; give them as "
                              f"--{missing[0].replace('_', '-')} N ... or use --preset")
        dims = check_dims(ModelDims(**{k: v for k, v in dims_kw.items() if v is not None}))
    layout = Layout(**{k: v for k, v in lay_kw.items() if v is not None})
    dtype = normalize_dtype(args.dtype or dtype or "bf16")
    if dtype == "tf32":
        raise ConfigError("--dtype tf32 is not a storage dtype; use fp32 (and --peak-tflops for the TF32 rate)")
    layout_name = args.memory_layout or ("megalite" if config_argv else "paper")
    if layout_name == "megalite":
        if args.param_dtype:
            raise ConfigError("--param-dtype describes the paper layout; megalite stores params in --dtype")
        prec = Precision.megalite(dtype)
    else:
        prec = Precision.for_dtype(dtype, args.param_dtype)
    if args.grad_reduce_dtype:
        prec = Precision(**{**vars(prec), "grad_comm": 4 if args.grad_reduce_dtype == "fp32" else 2})
    inter = args.bandwidth_gbytes * GB if args.bandwidth_gbytes else None
    if args.bandwidth_gbps:
        inter = args.bandwidth_gbps * 1e9 / 8  # bits -> bytes, exactly: 25 Gb/s = 3.125 GB/s
    intra = args.intra_bandwidth_gbytes * GB if args.intra_bandwidth_gbytes else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and args.device:
        peak = peak_flops(args.device, dtype)
        if peak is None:
            raise ConfigError(f"no {dtype} peak known for device {args.device!r}; pass --peak-tflops")
    fp8_peak = None
    if args.fp8 != "none":
        fp8_peak = peak_flops(args.device, "fp8") if args.device else None
        if args.device and fp8_peak is None:
            raise ConfigError(f"--fp8 {args.fp8}: device {args.device!r} has no FP8 tensor cores (or no known FP8 "
                              "peak): use --fp8 none, or an H100/H200-class device")
    hw = Hardware(peak_flops=peak, inter_bytes_per_s=inter, intra_bytes_per_s=intra, efficiency=args.efficiency,
                  fp8_peak_flops=fp8_peak)
    return dict(dims=dims, layout=layout, prec=prec, params=args.params, hw=hw,
                fp8=None if args.fp8 == "none" else (args.fp8, args.fp8_min_dim),
                hfu_convention=args.hfu_convention, dtype=dtype, memory_layout=layout_name,
                memory_device=args.memory_device, optimizer=args.optimizer)


def answer_questions(args: argparse.Namespace, kw: dict) -> tuple[Estimate, dict, list[str]]:
    """The estimate, plus the answers to the question flags (largest model, training time, a measured
    or achieved throughput) as JSON sections and text lines."""
    est_kw = {k: v for k, v in kw.items() if k not in ("dtype", "memory_layout", "memory_device", "optimizer")}
    lay: Layout = kw["layout"]
    dims: ModelDims | None = kw["dims"]
    sections: dict = {}
    lines: list[str] = []
    if args.largest_model:
        if not args.gpu_memory_gb:
            raise ConfigError("--largest-model needs --gpu-memory-gb (memory per device)")
        if args.params:
            raise ConfigError("--largest-model finds the parameter count: leave out --params")
        limit = args.gpu_memory_gb * GB * args.memory_fraction
        if dims is None:
            ans = largest_params(limit, lay, kw["prec"])
            est_kw["params"] = ans.params
            lines.append(f"largest model that fits in {limit / GB:.2f} GB per device (model states only, "
                         f"{ans.bytes_per_param:.4g} bytes/param at zero={lay.zero} dp={lay.dp}; x tp={lay.tp} "
                         f"x pp={lay.pp}): {ans.params / 1e9:.1f} B parameters")
        else:
            ans = largest_num_layers(dims, lay, limit, kw["prec"])
            est_kw["dims"] = dims = kw["dims"] = replace(dims, num_layers=int(ans.num_layers or 0))
            lines.append(f"largest model of this shape that fits in {limit / GB:.2f} GB per device (states + "
                         f"activations, worst stage): {ans.num_layers} layers, {ans.params / 1e9:.3f} B parameters")
        sections["largest_model"] = ans.to_dict()
    est = estimate(**est_kw)
    peak = kw["hw"].peak_flops
    if args.step_seconds:
        if not peak:
            raise ConfigError("--step-seconds needs a peak: pass --peak-tflops or --device")
        if est.model_flops_per_step is None:
            raise ConfigError("--step-seconds needs a model shape (a preset or --num-layers ...) for its FLOPs")
        u = utilizations(est, lay.world, args.step_seconds, peak)
        sections["measured"] = {"step_seconds": args.step_seconds, **u}
        lines.append(f"measured step {args.step_seconds:.4g} s: MFU {u['mfu']:.1%}, HFU {u['hfu']:.1%}, "
                     f"causal-halved MFU {u['mfu_causal']:.1%} "
                     f"({u['achieved_tflops']:.1f} hardware TFLOP/s per device)")
    x = args.achieved_tflops * 1e12 if args.achieved_tflops else None
    if x is not None:
        ach = {"achieved_tflops": x / 1e12, "aggregate_pflops": x * lay.world / 1e15,
               "percent_of_peak": 100 * x / peak if peak else None,
               "step_seconds": est.hardware_flops_per_step / lay.world / x if est.hardware_flops_per_step else None}
        sections["achieved"] = ach
        line = f"achieved {x / 1e12:.4g} TFLOP/s per device: {ach['aggregate_pflops']:.1f} PFLOP/s over {lay.world} devices"
        if peak:
            line += f", {ach['percent_of_peak']:.0f}% of the {peak / 1e12:.0f} TFLOP/s peak"
        if ach["step_seconds"]:
            line += f"; a step's hardware FLOPs take {ach['step_seconds']:.4g} s"
        lines.append(line)
    if args.mfu is not None and not args.train_tokens:
        raise ConfigError("--mfu goes with --train-tokens (how long training takes at that MFU)")
    if args.mfu is not None and est.model_flops_per_step and est.hardware_flops_per_step:
        hfu = args.mfu * est.hfu_ratio  # one count: HFU == MFU without recompute
        sections["at_mfu"] = {"mfu": args.mfu, "hfu": hfu}
        lines.append(f"MFU {args.mfu:.1%} is HFU {hfu:.1%} with recompute={lay.recompute} "
                     f"(hardware / model FLOPs = {hfu / args.mfu:.4f})")
    if args.train_tokens:
        tt = training_time(args.train_tokens, lay.world, est.params, est, dims, lay, Throughput(x, args.mfu, peak))
        sections["training_time"] = tt.to_dict()
        lines.append(f"training on {tt.tokens:.4g} tokens with {tt.devices} devices:")
        lines += [f"  {method:<18}{sec / DAY:8.1f} days   ({formula})" for method, formula, sec in tt.rows]
    return est, sections, lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, config_argv = _split_config_args(argv)
    args = build_parser().parse_args(ours)
    try:
        kw = resolve(args, config_argv)
        est, sections, lines = answer_questions(args, kw)
        moe_section, moe_lines = moe_report(kw["layout"], kw["prec"], vars(args), config_argv, kw["fp8"])  # {} when dense
        sections, lines = {**sections, **moe_section}, lines + moe_lines
        muon_section, muon_lines = muon_report(args.optimizer, kw["dims"], kw["layout"], args.muon_ns_steps)
        sections, lines = {**sections, **muon_section}, lines + muon_lines
    except MegaliteError as exc:
        return report(exc)
    if args.json:
        lay = kw["layout"]
        inputs = {"layout": vars(lay), "dtype": kw["dtype"], "memory_layout": kw["memory_layout"],
                  "precision": vars(kw["prec"]), "model": None if kw["dims"] is None else asdict(kw["dims"]),
                  "inter_bytes_per_s": kw["hw"].inter_bytes_per_s, "intra_bytes_per_s": kw["hw"].intra_bytes_per_s,
                  "peak_flops": kw["hw"].peak_flops}
        print(json.dumps({"inputs": inputs, **est.to_dict(), "peak_memory": peak_of(kw), **sections}, indent=2))
    else:
        print("\n".join([render(est, kw)] + (["", *lines] if lines else [])))
        if (note := estimate_only_note(args.preset)) is not None:
            print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main)())
