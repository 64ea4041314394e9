"""Refuse before step 1 a run that cannot fit: predicted peak bytes vs. the memory the machine has.

The prediction is the peak-memory model for this run's exact layout and dtype (`megalite.perfmodel.peak_memory`,
the one `tools/estimate.py` and `tools/plan.py` print): the interpreter + torch baseline (CPU) or CUDA context,
model states by ZeRO stage over dp x cp, and the step's transient parts (activations in flight, the logits and
cross-entropy buffers, gradient buckets, ZeRO-3's gather buffers, Muon's step copies, ...) plus allocator slack, for the busiest
pipeline stage; `bench/memory_peak.py` holds it against measured peaks. On CPU every process of this
machine draws on the same RAM, so their sum is compared with `MemAvailable` (/proc/meminfo); on GPU each
process with its device's free memory. A refusal names the numbers and the flags that would fit; `train.memory_check=false` skips it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megalite.config import PRESETS, Config, ModelArgs, ModelConfig
from megalite.config.presets import section_values
from megalite.config.derive import resolve, resolved_device, resolved_dtype
from megalite.data.tokenizer import load_tokenizer
from megalite.errors import ConfigError
from megalite.moe.config import MoEConfig
from megalite.perfmodel.estimate import Estimate, Layout, ModelDims, Precision, estimate
from megalite.perfmodel.config_inputs import spec_dims
from megalite.perfmodel.peak_memory import PeakMemory, fits, run_peak

GiB = 2**30


def run_precision(dtype: torch.dtype) -> Precision:
    """Bytes per element as megalite keeps them: fp32 runs hold fp32 weights, grads and Adam moments;
    16-bit runs hold 16-bit weights, fp32 main grads, an fp32 master copy and fp32 moments."""
    if dtype == torch.float32:
        return Precision.for_dtype("fp32")
    return Precision(param=2, grad=4, master=4, optimizer=8, activation=2)


def predicted_bytes(cfg: Config) -> float:
    """Peak bytes of one process of this run, per the peak-memory model (`predicted_peak`)."""
    return predicted_peak(cfg).total


def predicted_peak(cfg: Config) -> PeakMemory:
    """This run's predicted peak, term by term (a vocabulary of 0 must be resolved). The device's baseline is
    the model's default; the ZeRO-3 prefetch depth and the cp ring's block path are the config's."""
    dims, layout = run_inputs(cfg)
    device = resolved_device(cfg)
    return run_peak(dims, layout, run_precision(resolved_dtype(cfg, device)),
                    "cuda" if device.startswith("cuda") else "cpu", cfg.optimizer.name,
                    None if cfg.fp8.recipe == "none" else (cfg.fp8.recipe, cfg.fp8.min_dim),
                    cfg.parallel.zero3_prefetch,
                    torch_ring=cfg.model.kernels == "torch" or (cfg.model.kernels == "auto" and device == "cpu"))


def run_estimate(cfg: Config) -> Estimate:
    """The estimator's view of this run: its model, layout and dtype (a vocabulary of 0 must be resolved)."""
    dims, layout = run_inputs(cfg)
    dtype = resolved_dtype(cfg, resolved_device(cfg))
    return estimate(dims, layout, run_precision(dtype))


def run_inputs(cfg: Config) -> tuple[ModelDims, Layout]:
    """The perfmodel's inputs for this run: its model shape and its layout and batch."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    dims = spec_dims(ModelArgs.from_config(cfg))
    layout = Layout(tp=par.tp, pp=par.pp, dp=par.dp, zero=par.zero, sp=par.sp, vpp=par.vpp, schedule=par.schedule,
                    micro_batch_size=tr.micro_batch_size, global_batch_size=tr.global_batch_size,
                    recompute=m.recompute, cp=par.cp, cp_mode=par.cp_mode, cp_a2a=par.cp_a2a,
                    document_mask=cfg.data.document_mask, ep=par.ep)
    return dims, layout


def available_bytes(device: torch.device) -> int | None:
    """Free device memory on CUDA; MemAvailable on Linux CPUs; None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Alternative:
    flags: str
    needed: float


def alternatives(cfg: Config, processes: int, available: float) -> list[Alternative]:
    """Single changes that fit: a smaller micro-batch (same global batch), recompute, a higher ZeRO
    stage (dp > 1), context parallelism on the same processes (dp halves, cp doubles: each rank holds
    half the tokens of every sequence), a smaller preset; cheapest in lost speed first."""
    tried: list[tuple[str, Config]] = []
    mb = cfg.train.micro_batch_size // 2
    while mb >= 1:
        tried.append((f"--train.micro_batch_size {mb}", _with(cfg, "train", micro_batch_size=mb)))
        mb //= 2
    for mode in ("selective", "full"):
        if cfg.model.recompute != mode and not (mode == "selective" and cfg.model.recompute == "full"):
            tried.append((f"--model.recompute {mode}", _with(cfg, "model", recompute=mode)))
    if cfg.parallel.dp > 1:
        for stage in range(cfg.parallel.zero + 1, 4):
            tried.append((f"--parallel.zero {stage}", _with(cfg, "parallel", zero=stage)))
    cp, dp = cfg.parallel.cp, cfg.parallel.dp
    while dp % 2 == 0 and cfg.model.seq_len % (4 * cp) == 0:
        cp, dp = 2 * cp, dp // 2
        tried.append((f"--parallel.cp {cp}", _with(cfg, "parallel", cp=cp, dp=dp)))
    found = [Alternative(flags, need) for flags, c in tried
             if (need := _needed(c, processes)) is not None and fits(need, available)]
    if not found:  # nothing short of a smaller model: the presets that fit with this batch and layout
        for name, values in PRESETS.items():
            shape: dict[str, Any] = {k: v for k, v in section_values(values).items()
                                     if k != "vocab_size"}  # the tokenizer's stays
            model = dataclasses.replace(ModelConfig(), **shape, preset=name, vocab_size=cfg.model.vocab_size,
                                        recompute=cfg.model.recompute,
                                        make_vocab_divisible_by=cfg.model.make_vocab_divisible_by)
            table = values.get("moe", {})
            moe = MoEConfig(**table) if isinstance(table, Mapping) else MoEConfig()
            par = cfg.parallel
            smaller = resolve(dataclasses.replace(cfg, model=model, moe=moe), par.dp * par.tp * par.cp * par.pp)
            need = _needed(smaller, processes)
            if need is not None and fits(need, available):
                found.append(Alternative(f"--model.preset {name}", need))
    return found[:4]


def _needed(cfg: Config, processes: int) -> float | None:
    """Predicted bytes of `processes` processes; None where the layout cannot run this config (e.g.
    a preset's layers not divisible by pp, or a micro-batch that does not divide the global batch)."""
    try:
        return predicted_bytes(cfg) * processes
    except ConfigError:
        return None


def _with(cfg: Config, section: str, **values: object) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def check_memory(cfg: Config, world_size: int, local_rank: int = 0, available: int | None = None) -> str:
    """Before any process group exists (so a refusing rank leaves none of the others waiting in a
    collective): raise ConfigError when the predicted peak exceeds `available` (default: what this
    machine or this rank's GPU has). The vocabulary is the tokenizer's where the config leaves it
    at 0; a tokenizer that cannot be read is a DataError here (a check that cannot run is no pass).
    Returns the one line that says what was predicted and compared (`check_memory_of`)."""
    device = torch.device(resolved_device(cfg))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
    # CPU: the processes on this machine share its RAM; GPU: one device each.
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if device.type == "cpu" else 1
    vocab = tokenizer_vocab_size(cfg)
    sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    return check_memory_of(sized, device, processes, available)


def tokenizer_vocab_size(cfg: Config) -> int:
    """What `model.vocab_size = 0` becomes: the tokenizer's size (the demo tokenizer's without one).

    Read by the same loader the data uses (`load_tokenizer`: SentencePiece, tokenizer.json or tiktoken),
    so a file the run can train with is one this check can size; one it cannot read is its DataError."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if not cfg.data.tokenizer:
        return cfg.data.demo_vocab_size
    return load_tokenizer(cfg.data.tokenizer).vocab_size


def check_memory_of(cfg: Config, device: torch.device, processes: int, available: int | None = None) -> str:
    """`check_memory` for `processes` processes of this config sharing `device`'s memory; the line that says
    the prediction and what it was compared with (printed at start and by `--check-config`, a run that
    fits included), or a ConfigError naming the flags that fit."""
    if not cfg.train.memory_check:
        return "memory check: off (train.memory_check=false)"
    peak = predicted_peak(cfg)
    needed = peak.total * processes
    per = f" ({processes} processes x {needed / processes / GiB:.1f} GiB)" if processes > 1 else ""
    predicted = f"predicted peak per process {peak.summary(top=3)}" + (
        f", {needed / GiB:.1f} GiB for the {processes} processes" if processes > 1 else "")
    where = "free RAM (MemAvailable)" if device.type == "cpu" else f"free memory on {device}"
    available = available_bytes(device) if available is None else available
    if available is None:
        return f"memory check: {predicted}; {where} unknown, not compared"
    if fits(peak.total, available, processes):  # the comparison tools/plan.py's fit filter makes
        return f"memory check: {predicted}; fits in {available / GiB:.1f} GiB {where}"
    found = alternatives(cfg, processes, available)
    hint = ("; these fit: " + ", ".join(f"{a.flags} ({a.needed / GiB:.1f} GiB)" for a in found) if found
            else "; no single change fits: use a machine with more memory or more processes (tp/pp/zero)")
    raise ConfigError(f"this run needs about {needed / GiB:.1f} GiB{per} (peak per process {peak.summary()}, as "
                      f"tools/estimate.py counts it) but {where} is {available / GiB:.1f} GiB{hint}; "
                      "train.memory_check=false runs it anyway")
