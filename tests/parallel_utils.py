"""Helpers for functions that run inside `DistWorld` ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megalite.optim.config import OptimizerConfig
from megalite.optim.loss_scale import LossScaler
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.counter import CommCounter
from megalite.parallel.state import ParallelState, create_groups
from megalite.pipeline.engine import PipelineEngine
from megalite.training.step import StepContext, StepResult, train_step

_GROUPS: dict[tuple[int, int, int, int], ParallelState] = {}  # per worker process: groups are expensive


def layout(tp: int, pp: int = 1, dp: int | None = None, sp: bool = False, cp: int = 1) -> ParallelState:
    """A ParallelState for this rank (groups created once per layout per worker, then reused)."""
    world = dist.get_world_size()
    dp = dp if dp is not None else world // (tp * cp * pp)
    key = (tp, pp, dp, cp)
    if key not in _GROUPS:
        state = ParallelState(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), cp=cp)
        create_groups(state)
        _GROUPS[key] = state
    return replace(_GROUPS[key], sp=sp, counter=CommCounter())


def tiny_model_cfg(arch: str = "llama", **overrides: object):
    """A small dense model config (attribute access only, like megalite.config.ModelArgs)."""
    from types import SimpleNamespace

    from megalite.mla.config import MLAConfig
    from megalite.moe.config import MoEConfig
    from megalite.mtp.config import MTPConfig

    base = dict(arch=arch, num_layers=2, hidden_size=32, num_heads=8 if arch == "llama" else 4,
                num_kv_heads=4,
                ffn_hidden_size=64, seq_len=8, vocab_size=61, make_vocab_divisible_by=4, norm_eps=1e-5,
                rope_theta=10000.0, dropout=0.0, tie_embeddings=arch == "gpt2", init_std=0.02,
                kernels="torch", recompute="none", qk_norm=False, head_dim=0, moe=MoEConfig(), mla=MLAConfig(),
                mtp=MTPConfig())
    from megalite.config.schema import ModelConfig

    # every other [model] field at its default: no RoPE scaling, no layer pattern or attention variant
    base.update({k: v for k, v in vars(ModelConfig()).items() if k not in base})
    base.update(overrides)
    return SimpleNamespace(**base)


def with_sections(cfg: Any, **sections: object) -> Any:
    """A copy of model config `cfg` (a `tiny_model_cfg` namespace or a `ModelArgs`) with these sections replaced
    (`mla=`, `mtp=`, `moe=`): what the model reads of them comes from its config, as in a run."""
    from dataclasses import is_dataclass
    from types import SimpleNamespace

    if is_dataclass(cfg):
        return replace(cfg, **sections)  # type: ignore[type-var]
    return SimpleNamespace(**{**vars(cfg), **sections})


def tiny_train_cfg(steps: int = 3, lr: float = 1e-2, clip_grad: float = 1.0):
    from types import SimpleNamespace

    return SimpleNamespace(lr=lr, min_lr=lr, warmup_steps=0, steps=steps, clip_grad=clip_grad)


# Adam hyper-parameters the optimizer parity tests share (the reference and the ZeRO optimizer alike).
HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
# The same as the [optimizer] section `build_distributed_optimizer` takes (its learning rate comes per step).
ADAMW = OptimizerConfig(weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8)


def reference_optimizer(model: torch.nn.Module, state: ParallelState, **hyper: Any) -> ReferenceOptimizer:
    """The replicated AdamW oracle with the shared `HYPER` (any of them overridden by name)."""
    return ReferenceOptimizer(model, state, **{**HYPER, **hyper})  # type: ignore[arg-type]


def step_context(model: torch.nn.Module | PipelineEngine, state: ParallelState, dtype: torch.dtype = torch.float32,
                 settings: Any = None, schedule: str = "1f1b", scaler: LossScaler | None = None) -> StepContext:
    """A training-step context for a whole model (pp = 1) or a pipeline engine: `settings` defaults to
    `tiny_train_cfg()`, the loss scaler to a disabled one (fp32/bf16)."""
    return StepContext.build(model, state, dtype, settings if settings is not None else tiny_train_cfg(),
                             scaler if scaler is not None else LossScaler(False), schedule)


def train_steps(model: torch.nn.Module | PipelineEngine, state: ParallelState, opt: Any,
                steps: list[list[tuple[torch.Tensor, torch.Tensor]]], settings: Any = None,
                dtype: torch.dtype = torch.float32, schedule: str = "1f1b", start: int = 0) -> list[StepResult]:
    """`train_step` over `steps` (each a list of micro-batches), numbered from `start`, one context."""
    ctx = step_context(model, state, dtype, settings, schedule)
    return [train_step(ctx, opt, batches, start + i) for i, batches in enumerate(steps)]


def random_steps(cfg, steps: int, rows: int) -> list[torch.Tensor]:
    """`steps` batches of `rows` random token rows (seq_len + 1: inputs and shifted targets), fixed seed."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=gen) for _ in range(steps)]


def micro_batches(d: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) micro-batches of `micro` rows each."""
    return [(d[i:i + micro, :-1], d[i:i + micro, 1:]) for i in range(0, d.shape[0], micro)]
