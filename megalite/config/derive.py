"""Derived values of a Config: the fields that default to "derive me" (0 / None), device and dtype."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from megalite.config.schema import Config
from megalite.errors import ConfigError

if TYPE_CHECKING:
    import torch




def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def resolve(cfg: Config, world_size: int) -> Config:
    """A copy of `cfg` with the derived values filled in (idempotent; vocab_size stays as is).

    dp = world_size // (tp*cp*pp) (at least 1, so a bad layout is reported by `validate` with its
    numbers rather than as dp=0); num_kv_heads = num_heads; ffn_hidden_size = llama's SwiGLU
    width round_up(int(8h/3), 64) (LLaMA, Touvron et al. 2023) or gpt2's 4h; tie_embeddings = the
    arch default; global_batch_size = micro_batch_size * dp; pp_layers, where layers differ in cost (a layer
    pattern), the split that balances the pipeline stages by cost (`layers.balanced_pp_layers`).
    """
    out = copy.deepcopy(cfg)
    m, par, tr = out.model, out.parallel, out.train
    if par.dp == 0 and par.tp > 0 and par.pp > 0 and par.cp > 0:
        par.dp = max(1, world_size // (par.tp * par.cp * par.pp))
    if m.num_kv_heads == 0:
        m.num_kv_heads = m.num_heads
    if m.ffn_hidden_size == 0:
        if m.arch == "llama":
            m.ffn_hidden_size = _round_up(int(8 * m.hidden_size / 3), 64)
        elif m.arch == "gpt2":
            m.ffn_hidden_size = 4 * m.hidden_size
    # The arch's own activation, named in the saved config (a model namespace built by a tool may not carry it).
    if getattr(m, "mlp", None) == "auto" and m.arch in ("llama", "gpt2"):
        m.mlp = "swiglu" if m.arch == "llama" else "gelu"
    if m.tie_embeddings is None and m.arch in ("llama", "gpt2"):
        m.tie_embeddings = m.arch == "gpt2"
    if tr.global_batch_size == 0 and par.dp > 0:
        tr.global_batch_size = tr.micro_batch_size * par.dp
    if not par.pp_layers:  # layers of unequal cost (model.layer_types): stages balanced by cost, not by count
        from megalite.config.layers import balanced_pp_layers

        par.pp_layers = balanced_pp_layers(out)
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
