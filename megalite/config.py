"""Typed run configuration: nested dataclasses, presets, TOML + `--section.field` CLI, validation.

One `Config` object describes a run. It is built by `parse_args` (or `config_from_dict`) with the
precedence

    dataclass defaults < model.preset < TOML file (--config) < command line

then `resolve(cfg, world_size)` fills the values that default to "derive me" (0 / None), and
`validate(cfg, world_size, device_type)` checks every rule at once, before any GPU time is spent,
and raises one `ConfigError` listing each problem with its fix. The rules are Megatron-core's
(world = tp*pp*dp, layers split evenly over stages, heads divisible by tp, global batch divisible
by micro-batch x dp) plus the seed lecture's "most common configuration error": fewer
micro-batches than pipeline stages, where the pipeline spends most of its time idle
(bubble (P-1)/(M+P-1), Narayanan et al. 2021).

Each field's one-line doc lives in its `metadata["doc"]`, which `--help` prints.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import tomli_w

from megalite import config_cli as cli
from megalite.errors import ConfigError

if TYPE_CHECKING:
    import torch


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with its one-line `--help` doc."""
    return field(default=default, metadata={"doc": doc})


def _lf(doc: str) -> Any:
    """A list field (empty by default) with its `--help` doc."""
    return field(default_factory=list, metadata={"doc": doc})


@dataclass
class ModelConfig:
    preset: str = _f("tiny", "named model size whose values replace these defaults (see PRESETS)")
    arch: str = _f("llama", "llama (RMSNorm, RoPE, SwiGLU) | gpt2 (LayerNorm, learned positions, GELU)")
    num_layers: int = _f(4, "transformer blocks")
    hidden_size: int = _f(128, "model width h")
    num_heads: int = _f(4, "attention (query) heads")
    num_kv_heads: int = _f(0, "key/value heads; 0 = num_heads (multi-head), fewer = grouped-query attention")
    ffn_hidden_size: int = _f(0, "MLP width; 0 = llama: round_up(int(8h/3), 64), gpt2: 4h")
    seq_len: int = _f(128, "tokens per training sequence")
    vocab_size: int = _f(0, "vocabulary size; 0 = the tokenizer's (filled in by pretrain.py)")
    make_vocab_divisible_by: int = _f(64, "embedding rows are padded to a multiple of this x tp")
    norm_eps: float = _f(1e-5, "epsilon of RMSNorm / LayerNorm")
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama)")
    dropout: float = _f(0.0, "dropout probability on the embedding and the residual branches")
    tie_embeddings: bool | None = _f(None, "share input/output embedding; unset = arch default (llama no, gpt2 yes)")
    init_std: float = _f(0.02, "std of the normal weight init")
    kernels: str = _f("auto", "auto | torch | triton (auto = triton on CUDA, torch elsewhere)")
    recompute: str = _f("none", "activation recompute: none | selective (attention core) | full (whole block)")


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel size (Megatron column/row-parallel linears)")
    pp: int = _f(1, "pipeline-parallel stages")
    dp: int = _f(0, "data-parallel size; 0 = world_size // (tp*pp)")
    sp: bool = _f(False, "sequence parallelism: shard norm/dropout activations over the tp ranks")
    vpp: int = _f(1, "virtual pipeline chunks per rank (interleaved schedule)")
    schedule: str = _f("1f1b", "pipeline schedule: 1f1b | gpipe | interleaved")
    zero: int = _f(0, "ZeRO stage 0..3: shard optimizer state (1), + grads (2), + params (3) over dp")
    pp_layers: list[int] = _lf("layers per (virtual) stage in model order; empty = even split")
    timeout_s: float = _f(600.0, "collective timeout in seconds before a hung rank is reported")
    backend: str = _f("auto", "process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo")


@dataclass
class TrainConfig:
    steps: int = _f(300, "optimizer steps to train")
    micro_batch_size: int = _f(8, "sequences per micro-batch per data-parallel rank")
    global_batch_size: int = _f(0, "sequences per optimizer step; 0 = micro_batch_size * dp")
    seed: int = _f(1234, "random seed (init, dropout, data order)")
    dtype: str = _f("auto", "auto | fp32 | bf16 | fp16 (auto = bf16 on CUDA, fp32 on CPU)")
    device: str = _f("auto", "auto | cpu | cuda")
    tune_malloc: bool = _f(True, "glibc: keep freed host memory for the next step instead of returning it to the "
                                 "OS (no page-fault storm on CPU; see megalite/runtime.py)")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(20, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases)")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    clip_grad: float = _f(1.0, "global gradient-norm clip; 0 = no clipping")
    eval_interval: int = _f(100, "steps between validation runs; 0 = never")
    eval_steps: int = _f(4, "validation batches per evaluation")
    max_skipped_steps: int = _f(10, "abort after this many consecutive skipped (inf/nan) steps")
    spike_factor: float = _f(0.0, "log a loss spike when loss > this x the running median loss; 0 = off")
    watchdog_factor: float = _f(20.0, "a step longer than this x the median step is a hang: report and exit; 0 = off")
    watchdog_min_s: float = _f(60.0, "never call a step a hang before it has run this many seconds")


@dataclass
class DataConfig:
    path: list[str] = _lf(".bin/.idx prefixes; empty = the embedded demo corpus")
    weights: list[float] = _lf("blend weights, one per path; empty = proportional to size")
    tokenizer: str = _f("", "SentencePiece .model file; empty = the demo tokenizer")
    valid_fraction: float = _f(0.02, "share of documents held out for validation")
    cache_dir: str = _f("", "empty = $MEGALITE_CACHE or ~/.cache/megalite")
    demo_max_bytes: int = _f(3_000_000, "bytes of the embedded demo corpus to use")
    demo_vocab_size: int = _f(2048, "vocabulary size of the demo tokenizer")


@dataclass
class CheckpointConfig:
    dir: str = _f("", "directory for checkpoints; empty = no checkpoints")
    interval: int = _f(0, "steps between saves; 0 = only at the end (when dir is set)")
    load: str = _f("", '"" (resume from the newest in dir if any) | "none" | "latest" | a checkpoint directory')
    keep: int = _f(3, "most recent checkpoints kept in dir (older ones are deleted)")


@dataclass
class LoggingConfig:
    dir: str = _f("runs/latest", "directory for metrics.jsonl and config.toml")
    interval: int = _f(10, "steps between log lines")
    wandb_project: str = _f("", "wandb project; empty = no wandb")
    wandb_entity: str = _f("", "wandb entity (team or user)")
    wandb_run_name: str = _f("", "wandb run name; empty = wandb's default")


def _section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


@dataclass
class Config:
    model: ModelConfig = _section(ModelConfig, "model shape and kernels")
    parallel: ParallelConfig = _section(ParallelConfig, "3D parallel layout and ZeRO")
    train: TrainConfig = _section(TrainConfig, "optimization and precision")
    data: DataConfig = _section(DataConfig, "datasets and tokenizer")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "saving and resuming")
    logging: LoggingConfig = _section(LoggingConfig, "metrics, JSONL and wandb")


def _sections() -> dict[str, type]:
    return cli.sections_of(Config)


def _frozen(d: dict[str, dict[str, object]]) -> Mapping[str, Mapping[str, object]]:
    return types.MappingProxyType({k: types.MappingProxyType(v) for k, v in d.items()})


# Model-section values of well-known sizes (read-only). Sources: GPT-2 (Radford et al. 2019),
# Pythia-160m-like llama, Llama 3.2 1B (GQA 32/8, tied embeddings), Llama 2 7B.
PRESETS: Mapping[str, Mapping[str, object]] = _frozen({
    "tiny": dict(arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, seq_len=128),
    "gpt2-tiny": dict(arch="gpt2", num_layers=4, hidden_size=128, num_heads=4, seq_len=128),
    "gpt2-small": dict(arch="gpt2", num_layers=12, hidden_size=768, num_heads=12, seq_len=1024,
                       vocab_size=50257),
    "gpt2-medium": dict(arch="gpt2", num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024,
                        vocab_size=50257),
    "llama-160m": dict(arch="llama", num_layers=12, hidden_size=768, num_heads=12, ffn_hidden_size=2048,
                       seq_len=2048),
    "llama-1b": dict(arch="llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                     ffn_hidden_size=8192, seq_len=2048, vocab_size=128256, rope_theta=500000.0,
                     tie_embeddings=True),
    "llama-7b": dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008,
                     seq_len=4096, vocab_size=32000),
})


# ----------------------------------------------------------------------------- building a Config


def config_from_dict(d: dict[str, Any]) -> Config:
    """A Config from a nested dict as read from TOML: defaults < d's preset < d's values."""
    errors: list[str] = []
    entries = cli.flatten(d, _sections(), "the config", errors)
    cfg = cli.build(Config, PRESETS, entries, errors)
    cli.raise_if(errors, "bad config")
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    """A Config from a TOML file (e.g. a run's saved `config.toml`)."""
    return config_from_dict(cli.read_toml(path))


def help_text() -> str:
    """The `--help` text: every field by section with its type, default and doc."""
    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(Config)}
    return cli.format_help(_sections(), docs, PRESETS)


def parse_args(argv: list[str] | None = None) -> Config:
    """Build a Config from `--config FILE.toml` and `--section.field VALUE` overrides.

    Precedence: defaults < preset (model.preset from the CLI, else the file, else "tiny") < file
    < CLI. Every unknown key and bad value is reported in one ConfigError. `--help` prints
    `help_text()` and exits 0.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    sections = _sections()
    bool_keys = {f"{s}.{n}" for s, c in sections.items() for n, t in cli.field_types(c).items()
                 if "bool" in cli.type_name(t)}
    parsed = cli.split_argv(args, bool_keys)
    if parsed.want_help:
        print(help_text(), end="")
        raise SystemExit(0)
    errors: list[str] = []
    entries: list[cli.Entry] = []
    if parsed.config_file is not None:
        entries += cli.flatten(cli.read_toml(parsed.config_file), sections, parsed.config_file, errors)
    entries += [(k, v, True) for k, v in parsed.overrides]
    cfg = cli.build(Config, PRESETS, entries, errors)
    cli.raise_if(errors, "bad config")
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain dict of `cfg`, None values dropped (TOML has no null; None means 'default')."""
    return {s: {k: v for k, v in sec.items() if v is not None} for s, sec in dataclasses.asdict(cfg).items()}


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write `cfg` as TOML, creating parent directories; atomic so a crash never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(tomli_w.dumps(config_to_dict(cfg)), encoding="utf-8")
    os.replace(tmp, p)


# ----------------------------------------------------------------------------- derived values


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def resolve(cfg: Config, world_size: int) -> Config:
    """A copy of `cfg` with the derived values filled in (idempotent; vocab_size stays as is).

    dp = world_size // (tp*pp) (at least 1, so a bad layout is reported by `validate` with its
    numbers rather than as dp=0); num_kv_heads = num_heads; ffn_hidden_size = llama's SwiGLU
    width round_up(int(8h/3), 64) (LLaMA, Touvron et al. 2023) or gpt2's 4h; tie_embeddings = the
    arch default; global_batch_size = micro_batch_size * dp.
    """
    out = copy.deepcopy(cfg)
    m, par, tr = out.model, out.parallel, out.train
    if par.dp == 0 and par.tp > 0 and par.pp > 0:
        par.dp = max(1, world_size // (par.tp * par.pp))
    if m.num_kv_heads == 0:
        m.num_kv_heads = m.num_heads
    if m.ffn_hidden_size == 0:
        if m.arch == "llama":
            m.ffn_hidden_size = _round_up(int(8 * m.hidden_size / 3), 64)
        elif m.arch == "gpt2":
            m.ffn_hidden_size = 4 * m.hidden_size
    if m.tie_embeddings is None and m.arch in ("llama", "gpt2"):
        m.tie_embeddings = m.arch == "gpt2"
    if tr.global_batch_size == 0 and par.dp > 0:
        tr.global_batch_size = tr.micro_batch_size * par.dp
    return out


def micro_batches_per_step(cfg: Config) -> int:
    """M = global_batch_size // (micro_batch_size * dp): micro-batches each rank runs per step."""
    if cfg.parallel.dp <= 0 or cfg.train.global_batch_size <= 0 or cfg.train.micro_batch_size <= 0:
        raise ConfigError("micro_batches_per_step needs a resolved config: call resolve(cfg, world_size) first")
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.parallel.dp)


def resolved_device(cfg: Config) -> str:
    """'cuda' or 'cpu': auto picks CUDA when torch sees a GPU; explicit cuda without one is an error."""
    import torch

    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device: use train.device=cpu or auto")
    if cfg.train.device not in ("cpu", "cuda"):
        raise ConfigError(f"train.device: {cfg.train.device!r} is not one of auto, cpu, cuda")
    return cfg.train.device


def resolved_dtype(cfg: Config, device: str) -> torch.dtype:
    """The compute dtype: auto = bf16 on CUDA (no loss scaling needed), fp32 on CPU."""
    import torch

    name = cfg.train.dtype
    if name == "auto":
        name = "bf16" if device == "cuda" else "fp32"
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in table:
        raise ConfigError(f"train.dtype: {cfg.train.dtype!r} is not one of auto, fp32, bf16, fp16")
    return table[name]


from megalite.config_validate import validate  # noqa: E402  (re-exported: the one validation entry point)


__all__ = [
    "PRESETS", "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "ModelConfig",
    "ParallelConfig", "TrainConfig", "config_from_dict", "config_to_dict", "help_text", "load_config",
    "micro_batches_per_step", "parse_args", "resolve", "resolved_device", "resolved_dtype",
    "save_config", "validate",
]
