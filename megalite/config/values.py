"""Config validation, single values: choices, ranges, finite numbers, text a path or TOML can hold, and the
limits of the fields read late in a run. One phrase per problem; `validate.py` collects them.

Every field is checked before any process group, dataset or model exists, so no value can fail after
step 1 (`--logging.sample_interval 1 --logging.sample_tokens -1` used to crash at the first sample) or
when config.toml is saved (a NUL byte or a non-UTF-8 byte in `logging.dir`, `checkpoint.dir` or
`logging.sample_prompt` cannot be written as TOML, nor passed to the operating system as a path).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping

from megalite.config.presets import PRESETS
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
})


def value_of(cfg: Config, key: str) -> Any:
    """The value of dotted `key` ("model.num_heads") in `cfg`."""
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


MAX_SEED = 2**64  # torch and numpy take unsigned 64-bit seeds
MAX_COUNT = 2**62  # steps, intervals: a count no run reaches, that stays exact in float64 arithmetic


def value_problems(cfg: Config) -> list[str]:
    """Choices and ranges of single values."""
    out = [f"{k}: {value_of(cfg, k)!r} is not one of {', '.join(c)}"
           for k, c in _CHOICES.items() if value_of(cfg, k) not in c]
    if cfg.model.preset not in PRESETS:
        out.append(f"model.preset: unknown preset {cfg.model.preset!r}: choose one of {', '.join(PRESETS)}")
    at_least_1 = ["model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads",
                  "model.ffn_hidden_size", "model.make_vocab_divisible_by", "parallel.tp", "parallel.cp", "parallel.pp",
                  "parallel.dp", "parallel.vpp", "train.steps", "train.micro_batch_size",
                  "train.global_batch_size", "checkpoint.keep", "logging.interval",
                  "data.demo_max_bytes", "data.demo_vocab_size"]
    out += [f"{k} must be >= 1, got {value_of(cfg, k)}" for k in at_least_1 if value_of(cfg, k) < 1]
    at_least_0 = ["model.vocab_size", "train.warmup_steps", "train.eval_interval", "train.eval_steps",
                  "train.max_skipped_steps", "checkpoint.interval", "train.clip_grad",
                  "train.min_lr", "train.spike_factor", "train.watchdog_factor", "train.watchdog_min_s",
                  "parallel.zero3_prefetch"]
    out += [f"{k} must be >= 0, got {value_of(cfg, k)}" for k in at_least_0 if value_of(cfg, k) < 0]
    positive = ["model.norm_eps", "model.rope_theta", "model.init_std", "parallel.timeout_s",
                "parallel.bucket_mb", "parallel.first_bucket_mb"]
    out += [f"{k} must be > 0, got {value_of(cfg, k)}" for k in positive if not value_of(cfg, k) > 0]
    if cfg.parallel.zero not in (0, 1, 2, 3):
        out.append(f"parallel.zero must be 0, 1, 2 or 3 (ZeRO stage), got {cfg.parallel.zero}")
    if cfg.model.seq_len < 2:
        out.append(f"model.seq_len must be >= 2 (inputs and shifted targets), got {cfg.model.seq_len}")
    if not 0 <= cfg.model.dropout < 1:
        out.append(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if not 0 <= cfg.data.valid_fraction < 1:
        out.append(f"data.valid_fraction must be in [0, 1), got {cfg.data.valid_fraction}")
    if not cfg.train.lr > 0:
        out.append(f"train.lr must be > 0, got {cfg.train.lr}")
    elif cfg.train.min_lr > cfg.train.lr:
        out.append(f"train.min_lr {cfg.train.min_lr} is above train.lr {cfg.train.lr}: set min_lr <= lr")
    if cfg.train.eval_interval > 0 and cfg.train.eval_steps < 1:
        out.append("train.eval_steps must be >= 1 when eval_interval > 0: raise it or set eval_interval=0")
    return out


def finite_problems(cfg: Config) -> list[str]:
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


def _text_problem(key: str, value: str) -> str | None:
    if "\x00" in value:
        return f"{key} contains a NUL byte (\\x00): no path or TOML string can hold it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a command line in another encoding arrives as surrogate escapes
        return f"{key} is not UTF-8 text (byte {e.start} of {value.encode('utf-8', 'surrogateescape')!r}): pass it in UTF-8"
    return None


def _texts(cfg: Config) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for section in dataclasses.fields(cfg):
        values: Any = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            v = getattr(values, f.name)
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                if isinstance(item, str):
                    out.append((f"{section.name}.{f.name}" + (f"[{i}]" if isinstance(v, list) else ""), item))
    return out


def text_problems(cfg: Config) -> list[str]:
    """Text fields with a NUL byte or not UTF-8. Checked first: such a path cannot even be looked at
    (`Path.exists` raises on a NUL byte), so the other checks run only when there is none."""
    return [p for key, value in _texts(cfg) if (p := _text_problem(key, value)) is not None]


def check_text_fields(cfg: Config) -> None:
    """Raise the text problems as one ConfigError (before anything reads a path from the config)."""
    from megalite.config import cli

    cli.raise_if(text_problems(cfg), "invalid config")


# Upper bounds of the fields where an absurd value hangs a step, overflows or allocates without limit (a bound only
# where that happens: a huge train.steps or interval is a long run or "never", which is what was asked).
# key -> (largest accepted value, why).
MAXIMA: Mapping[str, tuple[float, str]] = types.MappingProxyType({
    "model.seq_len": (2**24, "RoPE tables and attention masks are sized by it (index.json's bound too)"),
    "model.make_vocab_divisible_by": (2**16, "it pads the embedding: more would add rows, not divisibility"),
    "model.norm_eps": (1.0, "an epsilon guards a division; a large one is a scale, and beyond 3.4e38 inf in fp32"),
    "model.rope_theta": (1e30, "RoPE's base is raised to powers in fp32, which overflows near 3.4e38"),
    "model.init_std": (1.0, "real models use ~0.02; a larger std overflows the activations at step 1"),
    "parallel.bucket_mb": (2**20, "a bucket of a TiB of gradients is no bucket; larger values only overflow sizes"),
    "parallel.first_bucket_mb": (2**20, "as parallel.bucket_mb"),
    "train.micro_batch_size": (2**20, "one micro-batch of more sequences is allocated at once"),
    "train.global_batch_size": (2**24, "a step of more sequences (gradient accumulation) would never finish"),
    "train.lr": (10.0, "learning rates are <= ~1; beyond 10 the first update diverges, 1e308 overflows to inf"),
    "train.eval_steps": (2**20, "each evaluation runs them all: more would never let training go on"),
    "train.watchdog_min_s": (1e7, "as parallel.timeout_s: a timer longer than months overflows the OS wait"),
    "data.demo_vocab_size": (2**20, "the embedded corpus (~3 MB) cannot give a BPE vocabulary larger than that"),
    "data.streams": (2**24, "each stream feeds at least one sequence of train.global_batch_size per step"),
    "data.workers": (256, "tokenizer processes per rank: more than a machine's cores only thrash (1e9 forks)"),
    "data.prefetch": (1024, "steps of batches held in memory ahead of training"),
    "logging.sample_tokens": (2**20, "each new token is one forward pass: more would never end the sample"),
})


def maximum_problems(cfg: Config) -> list[str]:
    """Values above `MAXIMA`'s bounds, each with its reason; and the decoupled weight decay's own bound."""
    out = [f"{k} {value_of(cfg, k):g} is above {most:g}: {why}" for k, (most, why) in MAXIMA.items()
           if value_of(cfg, k) > most]
    if cfg.train.lr * cfg.optimizer.weight_decay >= 1:  # p <- p (1 - lr wd): at >= 1 every step flips or zeroes p
        out.append(f"train.lr x optimizer.weight_decay = {cfg.train.lr:g} x {cfg.optimizer.weight_decay:g} must be "
                   "< 1 (decoupled decay multiplies each weight by 1 - lr x wd every step)")
    return out


def field_problems(cfg: Config) -> list[str]:
    """One phrase per bad value among the ranges `validate`'s tables leave out."""
    out: list[str] = []
    lg, tr = cfg.logging, cfg.train
    if lg.sample_interval < 0:
        out.append(f"logging.sample_interval must be >= 0 (0 = never), got {lg.sample_interval}")
    if lg.sample_tokens < 1:
        out.append(f"logging.sample_tokens must be >= 1, got {lg.sample_tokens}")
    if tr.seed >= MAX_SEED:
        out.append(f"train.seed must be < 2^64 (an unsigned 64-bit seed), got {tr.seed}")
    for key, value in (("train.steps", tr.steps), ("train.warmup_steps", tr.warmup_steps),
                       ("train.eval_interval", tr.eval_interval), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("logging.interval", lg.interval), ("logging.sample_interval", lg.sample_interval)):
        if value > MAX_COUNT:
            out.append(f"{key} must be <= 2^62, got {value}")
    return out
