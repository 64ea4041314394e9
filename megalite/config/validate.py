"""Validation of a resolved megalite config: every rule in one place, all problems reported together.

Run before any process group, dataset or model exists, so a bad run fails before it costs anything.
`megalite.config.validate` is the public entry point.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from megalite.config import cli
from megalite.config.derive import resolve
from megalite.config.presets import PRESETS
from megalite.config.validate_features import (compile_problems, cp_mode_problems, fp8_problems, moe_problems,
                                              muon_problems)
from megalite.config.validate_fields import field_problems, text_problems
from megalite.fp8.costs import FP8_CHOICES
from megalite.mla.config import mla_problems
from megalite.model.params import count_model_params
from megalite.model.rope import RopeScaling, rope_scaling_problems
from megalite.mtp.config import mtp_problems

if TYPE_CHECKING:
    from megalite.config.schema import Config


_CHOICES: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "model.arch": ("llama", "gpt2"),
    "model.kernels": ("auto", "torch", "triton"),
    "model.recompute": ("none", "selective", "full"),
    "parallel.schedule": ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.cp_mode": ("ring", "allgather", "a2a", "hybrid"),
    "train.dtype": ("auto", "fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.fp8": FP8_CHOICES,
    "train.optimizer": ("adamw", "muon"),
})


def _get(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _value_problems(cfg: Config) -> list[str]:
    """Choices and ranges of single values."""
    out = [f"{k}: {_get(cfg, k)!r} is not one of {', '.join(c)}"
           for k, c in _CHOICES.items() if _get(cfg, k) not in c]
    if cfg.model.preset not in PRESETS:
        out.append(f"model.preset: unknown preset {cfg.model.preset!r}: choose one of {', '.join(PRESETS)}")
    at_least_1 = ["model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads",
                  "model.ffn_hidden_size", "model.make_vocab_divisible_by", "parallel.tp", "parallel.cp", "parallel.pp",
                  "parallel.dp", "parallel.vpp", "train.steps", "train.micro_batch_size",
                  "train.global_batch_size", "checkpoint.keep", "logging.interval",
                  "data.demo_max_bytes", "data.demo_vocab_size"]
    out += [f"{k} must be >= 1, got {_get(cfg, k)}" for k in at_least_1 if _get(cfg, k) < 1]
    at_least_0 = ["model.vocab_size", "train.warmup_steps", "train.eval_interval", "train.eval_steps",
                  "train.max_skipped_steps", "checkpoint.interval", "train.weight_decay", "train.clip_grad",
                  "train.min_lr", "train.spike_factor", "train.watchdog_factor", "train.watchdog_min_s",
                  "parallel.zero3_prefetch"]
    out += [f"{k} must be >= 0, got {_get(cfg, k)}" for k in at_least_0 if _get(cfg, k) < 0]
    positive = ["model.norm_eps", "model.rope_theta", "model.init_std", "train.adam_eps", "parallel.timeout_s",
                "parallel.bucket_mb", "parallel.first_bucket_mb"]
    out += [f"{k} must be > 0, got {_get(cfg, k)}" for k in positive if not _get(cfg, k) > 0]
    if cfg.parallel.zero not in (0, 1, 2, 3):
        out.append(f"parallel.zero must be 0, 1, 2 or 3 (ZeRO stage), got {cfg.parallel.zero}")
    if cfg.model.seq_len < 2:
        out.append(f"model.seq_len must be >= 2 (inputs and shifted targets), got {cfg.model.seq_len}")
    if not 0 <= cfg.model.dropout < 1:
        out.append(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if not 0 <= cfg.data.valid_fraction < 1:
        out.append(f"data.valid_fraction must be in [0, 1), got {cfg.data.valid_fraction}")
    for k in ("train.beta1", "train.beta2"):
        if not 0 <= _get(cfg, k) < 1:
            out.append(f"{k} must be in [0, 1), got {_get(cfg, k)}")
    if not cfg.train.lr > 0:
        out.append(f"train.lr must be > 0, got {cfg.train.lr}")
    elif cfg.train.min_lr > cfg.train.lr:
        out.append(f"train.min_lr {cfg.train.min_lr} is above train.lr {cfg.train.lr}: set min_lr <= lr")
    if cfg.train.eval_interval > 0 and cfg.train.eval_steps < 1:
        out.append("train.eval_steps must be >= 1 when eval_interval > 0: raise it or set eval_interval=0")
    return out


def _finite_problems(cfg: Config) -> list[str]:
    """Every float (and list of floats) must be finite: NaN passes every `<`/`>` check and would train on NaN,
    and an infinite timeout or learning rate is never what was meant."""
    out: list[str] = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            v = getattr(values, f.name)
            items = v if isinstance(v, list) else [v]
            if any(isinstance(x, float) and not math.isfinite(x) for x in items):
                out.append(f"{section.name}.{f.name} must be a finite number, got {v}")
    if math.isfinite(cfg.parallel.timeout_s) and cfg.parallel.timeout_s >= 1e7:
        out.append(f"parallel.timeout_s {cfg.parallel.timeout_s:g} is beyond what torch's stores accept: use < 1e7 "
                   "seconds (a hung collective should be reported, not waited on for months)")
    if cfg.train.seed < 0:
        out.append(f"train.seed must be >= 0 (numpy and torch seeds are unsigned), got {cfg.train.seed}")
    return out


# 16 TiB: more memory than any single accelerator or host offers (DeepSeek-V3's 671 B parameters, 2.4 TiB in fp32, still
# validate on one rank for the tools; the check before step 1 prices a real run's memory).
_MAX_RANK_BYTES = 2 ** 44


def _size_problems(cfg: Config, experts_valid: bool = True) -> list[str]:
    """Sizes no run can hold: odd RoPE head dims, and weights alone beyond any device's memory (refused
    with the numbers instead of allocating until the machine swaps or the OOM killer steps in)."""
    m, p = cfg.model, cfg.parallel
    out: list[str] = []
    if min(m.num_heads, m.hidden_size, p.tp, p.pp) < 1 or m.hidden_size % m.num_heads:
        return out  # reported elsewhere
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    if m.head_dim < 0 or (m.head_dim and m.arch != "llama"):
        out.append(f"model.head_dim {m.head_dim} must be 0 (hidden_size / num_heads) or, with model.arch=llama, > 0")
    elif m.arch == "llama" and head_dim % 2 and not cfg.mla.enabled:  # MLA rotates mla.qk_rope_head_dim
        out.append(f"model.hidden_size {m.hidden_size} / num_heads {m.num_heads} = head dim {head_dim} is odd; "
                   "rotary embeddings rotate pairs of dims: choose an even head dim")
    # Experts and shared experts included (their fields once they are valid: moe_problems reports the rest).
    n = count_model_params(m if experts_valid else dataclasses.replace(m, moe_experts=0),
                           cfg.mla if cfg.mla.enabled else None)
    weights = 4 * n / (p.tp * p.pp * max(1, p.ep))  # fp32 weights alone, the least a rank must hold
    if weights > _MAX_RANK_BYTES:
        out.append(f"the model has {n:.3g} parameters: its fp32 weights alone are {weights / 2**40:.3g} TiB per rank "
                   f"(tp {p.tp} x pp {p.pp} x ep {p.ep}), beyond any device's memory ({_MAX_RANK_BYTES / 2**40:g} "
                   "TiB): choose smaller model.* dims (moe_* widths and counts included) or more tp/pp/ep")
    return out


_STEP_DIR = re.compile(r"step_\d{8}(\.tmp)?")


def _is_saved_checkpoint(path: Path) -> bool:
    """A step directory by name, or any directory holding a megalite index next to its rank files."""
    if _STEP_DIR.fullmatch(path.name):
        return True
    return (path / "index.json").is_file() and next(path.glob("rank_*.safetensors"), None) is not None


def _path_problems(cfg: Config) -> list[str]:
    """Directories that exist as files, outputs under a file, and a checkpoint.dir inside a step directory."""
    out: list[str] = []
    # checkpoint.dir is checked (exit code 4, with a real write) by megalite.checkpoint.claim.claim_directory
    dirs = {"logging.dir": cfg.logging.dir, "data.cache_dir": cfg.data.cache_dir}
    for key, value in dirs.items():
        if not value:
            continue
        path = Path(value).expanduser()
        blocker = next((q for q in [path, *path.parents] if q.exists() and not q.is_dir()), None)
        if blocker == path:
            out.append(f"{key} {value} is an existing file, not a directory: choose a directory path")
        elif blocker is not None:
            out.append(f"{key} {value} lies under {blocker}, which is a file: choose a directory path")
    ckpt = cfg.checkpoint.dir
    if ckpt:
        path = Path(ckpt).expanduser().absolute()
        inner = next((q for q in [path, *path.parents] if _is_saved_checkpoint(q)), None)
        if inner is not None:
            out.append(f"checkpoint.dir {ckpt} is inside the saved checkpoint {inner}: set checkpoint.dir to the "
                       f"directory that holds the step_* directories ({inner.parent}), and use checkpoint.load "
                       "to pick a step")
    return out


def _layout_problems(cfg: Config, world_size: int) -> list[str]:
    """Shapes against the parallel layout (Megatron-core's rules) and the batch arithmetic."""
    m, p = cfg.model, cfg.parallel
    out: list[str] = []
    from megalite.dp.zero3 import zero3_problems  # the one place ZeRO-3's limits live (torch: imported late)

    out += zero3_problems(p.zero, p.vpp, p.pp > 1 and bool(m.tie_embeddings))
    if m.num_heads >= 1 and m.hidden_size % m.num_heads:
        out.append(f"model.hidden_size {m.hidden_size} is not divisible by model.num_heads {m.num_heads}: "
                   f"make hidden_size a multiple of num_heads")
    if m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
        out.append(f"model.num_heads {m.num_heads} is not divisible by model.num_kv_heads {m.num_kv_heads}: "
                   f"each kv head must serve a whole group of query heads")
    if min(p.tp, p.cp, p.pp, p.dp, p.vpp) < 1:
        return out  # reported by _value_problems; the arithmetic below would divide by zero
    model_parallel = p.tp * p.cp * p.pp
    if world_size != model_parallel * p.dp:
        names, sizes = ("tp*cp*pp", f"tp {p.tp} x cp {p.cp}") if p.cp > 1 else ("tp*pp", f"tp {p.tp}")
        fix = (f"set parallel.dp={world_size // model_parallel} (or 0 to derive it)"
               if world_size % model_parallel == 0 else f"launch a multiple of {names} = {model_parallel} processes")
        out.append(f"world_size {world_size} != {sizes} x pp {p.pp} x dp {p.dp} = {model_parallel * p.dp}: "
                   f"{fix} or change {names.replace('*', '/')}")
    out += _context_problems(cfg)
    out += cp_mode_problems(cfg)
    stages = p.pp * p.vpp
    if not p.pp_layers:
        if m.num_layers % stages:
            out.append(f"model.num_layers {m.num_layers} is not divisible by pp x vpp = {p.pp} x {p.vpp} = "
                       f"{stages}: change num_layers or give parallel.pp_layers (layers per stage)")
    else:
        if len(p.pp_layers) != stages:
            out.append(f"parallel.pp_layers has {len(p.pp_layers)} entries but pp x vpp = {stages} "
                       f"stages need one each")
        if any(n < 1 for n in p.pp_layers):
            out.append(f"parallel.pp_layers {p.pp_layers}: every stage needs at least 1 layer")
        if sum(p.pp_layers) != m.num_layers:
            out.append(f"parallel.pp_layers {p.pp_layers} sums to {sum(p.pp_layers)} but model.num_layers "
                       f"is {m.num_layers}")
    for key in ("model.num_heads", "model.num_kv_heads", "model.ffn_hidden_size"):
        if _get(cfg, key) % p.tp:
            out.append(f"{key} {_get(cfg, key)} is not divisible by parallel.tp {p.tp}: "
                       f"each tensor-parallel rank needs an equal share")
    if p.sp and p.tp == 1:
        out.append("parallel.sp needs parallel.tp > 1 (it shards activations over the tp ranks): "
                   "set tp >= 2 or sp=false")
    elif p.sp and m.seq_len % p.tp:
        out.append(f"model.seq_len {m.seq_len} is not divisible by parallel.tp {p.tp}, which "
                   f"sequence parallelism needs: change seq_len or tp")
    out += _batch_problems(cfg)
    return out


def _context_problems(cfg: Config) -> list[str]:
    """Context parallelism: the zigzag split needs 2*cp equal chunks of every sequence, and SP cuts each
    rank's S/cp tokens over tp. It composes with tp (+sp), pp (every schedule), dp and ZeRO 0-3 (sharded over
    dp x cp); the attention runs the ring in torch block math with either kernel backend."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return []
    out = []
    if m.seq_len % (2 * p.cp):
        out.append(f"model.seq_len {m.seq_len} is not divisible by 2 x parallel.cp = {2 * p.cp}: context "
                   f"parallelism cuts each sequence into 2*cp chunks (rank r holds chunks r and 2cp-1-r, so every "
                   f"rank does the same causal attention work); use a multiple of {2 * p.cp}")
    if p.sp and (m.seq_len // p.cp) % p.tp:
        out.append(f"model.seq_len / cp = {m.seq_len // p.cp} tokens per cp rank is not divisible by parallel.tp "
                   f"{p.tp}, which sequence parallelism needs: change seq_len, cp or tp")
    return out


def _batch_problems(cfg: Config) -> list[str]:
    """Global batch vs micro-batch x dp, and micro-batches vs pipeline stages (the bubble)."""
    p, t = cfg.parallel, cfg.train
    out: list[str] = []
    if min(t.micro_batch_size, t.global_batch_size) < 1:
        return out
    per_step = t.micro_batch_size * p.dp
    m_count = t.global_batch_size // per_step
    if t.global_batch_size % per_step:
        out.append(f"train.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
                   f"{t.micro_batch_size} x dp {p.dp} = {per_step}: use a multiple of {per_step}, e.g. "
                   f"{max(1, m_count) * per_step}")
    if p.pp > 1 and m_count < p.pp:
        out.append(f"only M={m_count} micro-batches per step for pp={p.pp} pipeline stages "
                   f"(M = global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} "
                   f"x dp {p.dp})): the pipeline would idle most of the time; set train.global_batch_size "
                   f">= {per_step * p.pp} (or lower micro_batch_size)")
    from megalite.pipeline.schedules import CHUNKS, layout_problems  # lazily: megalite.config stays torch-free

    if p.schedule in CHUNKS:  # an unknown name is reported with the other choices
        out += layout_problems(p.schedule, p.pp, p.vpp)
    out += _zero_bubble_problems(cfg)
    if p.schedule == "interleaved":
        if p.pp > 1 and m_count % p.pp:
            out.append(f"parallel.schedule=interleaved needs M={m_count} micro-batches per step to be a "
                       f"multiple of pp={p.pp}: set train.global_batch_size to a multiple of "
                       f"{per_step * p.pp}")
    return out


def _zero_bubble_problems(cfg: Config) -> list[str]:
    """ZB-V (Qi et al. 2024) beyond its layout rules (`pipeline.schedules.layout_problems`): tied embeddings."""
    from megalite.pipeline.schedules import V_SHAPED

    p, m = cfg.parallel, cfg.model
    out: list[str] = []
    if p.schedule in V_SHAPED:
        if m.tie_embeddings and p.pp > 1:
            out.append("parallel.schedule=zbv puts the embedding and the head on the same rank, which tied "
                       "embeddings do not support yet: set model.tie_embeddings=false or use zb-h1")
    return out


def _environment_problems(cfg: Config, device_type: str) -> list[str]:
    """Kernels, backend and device against where the run executes; files and blending."""
    out: list[str] = []
    if cfg.model.kernels == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        out.append("model.kernels=triton on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                   "or use model.kernels=torch")
    if cfg.parallel.backend == "nccl" and device_type != "cuda":
        out.append(f"parallel.backend=nccl needs CUDA but the run is on {device_type}: use backend=gloo or auto")
    if cfg.train.device == "cuda" and device_type != "cuda":
        out.append(f"train.device=cuda but the run is on {device_type}: use train.device=cpu or auto")
    if cfg.checkpoint.interval > 0 and not cfg.checkpoint.dir:
        out.append(f"checkpoint.interval={cfg.checkpoint.interval} needs checkpoint.dir: set a directory "
                   f"or interval=0")
    if cfg.checkpoint.load == "latest" and not cfg.checkpoint.dir:
        out.append("checkpoint.load=latest needs checkpoint.dir to search: set it or give a checkpoint directory")
    d = cfg.data
    if d.weights and len(d.weights) != len(d.path):
        out.append(f"data.weights has {len(d.weights)} entries but data.path has {len(d.path)}: "
                   f"give one weight per path or none")
    if d.weights and (min(d.weights) < 0 or sum(d.weights) <= 0):
        out.append(f"data.weights {d.weights} must be >= 0 with a positive sum")
    return out


def validate(cfg: Config, world_size: int, device_type: str = "cpu") -> None:
    """Check every rule and raise one ConfigError listing all problems, one line each.

    `cfg` should come from `resolve`; it is resolved again here (idempotent) so an unresolved
    config is reported by its real problems, not as "dp must be >= 1". `device_type` is where the
    run executes ("cpu" or "cuda"), i.e. `resolved_device(cfg)`.
    """
    cfg = resolve(cfg, world_size)
    problems: list[str] = []
    if world_size < 1:
        problems.append(f"world_size must be >= 1, got {world_size}: check WORLD_SIZE from the launcher")
    texts = text_problems(cfg)  # NUL / non-UTF-8 text: paths that cannot even be looked at (validate_fields.py)
    problems += texts
    problems += _value_problems(cfg)
    problems += _finite_problems(cfg)
    problems += _path_problems(cfg) if not texts else []
    moe = moe_problems(cfg)
    problems += _size_problems(cfg, experts_valid=not moe)
    problems += _layout_problems(cfg, world_size)
    problems += moe
    problems += mtp_problems(cfg.mtp, cfg.model, cfg.parallel)
    if cfg.model.qk_norm and cfg.model.arch != "llama":  # Qwen3's q/k norm: an RMSNorm, llama arch only
        problems.append(f"model.qk_norm needs model.arch=llama, got {cfg.model.arch!r}")
    problems += muon_problems(cfg)
    problems += mla_problems(cfg.mla, cfg.model) + rope_scaling_problems(RopeScaling.of(cfg.model))
    problems += _environment_problems(cfg, device_type)
    problems += field_problems(cfg)  # ranges read late in a run (validate_fields.py)
    problems += fp8_problems(cfg, device_type)
    problems += compile_problems(cfg, device_type)
    cli.raise_if(problems, "invalid config")


