"""Validation of a resolved megalite config: every rule in one place, all problems reported together.

Run before any process group, dataset or model exists, so a bad run fails before it costs anything.
`megalite.config.validate` is the public entry point. The rules live by concept: `values.py` (single values),
`layout.py` (shapes against the parallel layout), `environment.py` (where the run executes), and each feature's
own checks in its folder (`megalite/moe/config.py`, `megalite/optim/config.py`, `megalite/fp8/config.py`).
"""

from __future__ import annotations

import copy

from megalite.config import cli
from megalite.config.derive import resolve
from megalite.config.environment import compile_problems, environment_problems, path_problems
from megalite.config.layers import layer_problems
from megalite.config.layout import layout_problems, size_problems
from megalite.config.schema import Config, ModelArgs, ModelConfig
from megalite.config.values import field_problems, finite_problems, maximum_problems, text_problems, value_problems
from megalite.fp8 import config as fp8_config
from megalite.moe import config as moe_config
from megalite.mla.config import MLAConfig, mla_problems
from megalite.mla.costs import mla_gemms
from megalite.moe.config import MoEConfig
from megalite.mtp.config import MTPConfig, mtp_problems
from megalite.optim import config as optim_config


def validate(cfg: Config, world_size: int, device_type: str = "cpu") -> None:
    """Check every rule and raise one ConfigError listing all problems, one line each.

    `cfg` should come from `resolve`; it is resolved again here (idempotent) so an unresolved
    config is reported by its real problems, not as "dp must be >= 1". `device_type` is where the
    run executes ("cpu" or "cuda"), i.e. `resolved_device(cfg)`.
    """
    cli.raise_if(problems_of(cfg, world_size, device_type), "invalid config")


def model_problems(model: ModelConfig, moe: MoEConfig, mla: MLAConfig, mtp: MTPConfig) -> list[str]:
    """pretrain.py's rules for a model alone, one line per problem: the model sections (`[model]`, `[moe]`, `[mla]`,
    `[mtp]`) in a run with every other setting at its default, on one CPU process. The one check every entry point
    that meets a model outside a run config makes (a checkpoint's index.json: megalite/checkpoint/index_check.py,
    read by generate, export_hf, convert_checkpoint and train.init_from; the estimator's and planner's dims), so a
    rule added to `problems_of` reaches them all."""
    cfg = Config()
    cfg.model, cfg.moe, cfg.mla, cfg.mtp = copy.deepcopy(model), copy.deepcopy(moe), copy.deepcopy(mla), copy.deepcopy(mtp)
    if cfg.model.vocab_size == 0:  # the tokenizer's, in a run: any size the model takes
        cfg.model.vocab_size = 1
    return problems_of(cfg, 1, "cpu")


def problems_of(cfg: Config, world_size: int, device_type: str) -> list[str]:
    """Every rule's problems with `cfg` (`validate`'s list)."""
    cfg = resolve(cfg, world_size)
    problems: list[str] = []
    if world_size < 1:
        problems.append(f"world_size must be >= 1, got {world_size}: check WORLD_SIZE from the launcher")
    texts = text_problems(cfg)  # NUL / non-UTF-8 text: paths that cannot even be looked at (values.py)
    problems += texts
    problems += value_problems(cfg)
    problems += finite_problems(cfg)
    problems += path_problems(cfg) if not texts else []
    m, p = cfg.model, cfg.parallel
    moe = moe_config.problems(cfg.moe, m.num_layers, m.ffn_hidden_size, p.tp, p.dp, p.cp, p.ep)
    problems += size_problems(cfg, experts_valid=not moe)
    problems += layout_problems(cfg, world_size)
    problems += moe
    problems += mtp_problems(cfg.mtp, cfg.model, cfg.parallel)
    if cfg.model.qk_norm and cfg.model.arch != "llama":  # Qwen3's q/k norm: an RMSNorm, llama arch only
        problems.append(f"model.qk_norm needs model.arch=llama, got {cfg.model.arch!r}")
    problems += layer_problems(cfg)  # the layer pattern and the attention / MLP variants (layers.py)
    problems += optim_config.problems(cfg.optimizer, cfg.muon)
    from megalite.model.rope import RopeScaling, rope_scaling_problems  # torch: late, megalite.config stays light

    problems += mla_problems(cfg.mla, cfg.model) + rope_scaling_problems(RopeScaling.of(cfg.model))
    problems += inert_problems(cfg)
    problems += environment_problems(cfg, device_type)
    problems += field_problems(cfg)  # ranges read late in a run (values.py)
    problems += maximum_problems(cfg)  # upper bounds where an absurd value hangs or overflows (values.py)
    problems += fp8_config.problems(cfg.fp8, cfg.train.dtype, device_type)
    mla_linears = mla_gemms(m.hidden_size, m.num_heads, cfg.mla, cfg.fp8.min_dim) if cfg.mla.enabled else None
    problems += fp8_config.layout_problems(cfg.fp8, ModelArgs.from_config(cfg), p.tp, p.cp, mla_linears)
    problems += compile_problems(cfg, device_type)
    return problems


# The fields a feature reads only while it is on, each with its switch: set apart from its default while the
# feature is off, a field cannot apply, and a run that ignored it would train something other than the user meant.
_ROPE_FIELDS = ("rope_factor", "rope_original_max_positions", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                "rope_mscale_all_dim", "rope_low_freq_factor", "rope_high_freq_factor")


def inert_problems(cfg: Config) -> list[str]:
    """One line per field set (to other than its default) for a feature that is off: MLA's widths without
    mla.kv_lora_rank, the RoPE scaling's parameters with model.rope_scaling none, mtp.loss_weight without MTP."""
    out: list[str] = []
    model_defaults, mla_defaults, mtp_defaults = ModelConfig(), MLAConfig(), MTPConfig()
    if not cfg.mla.enabled:
        widths = [f"mla.{n}" for n in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
                  if getattr(cfg.mla, n) != getattr(mla_defaults, n)]
        if widths:
            out.append(f"{', '.join(widths)} set but MLA is off (mla.kv_lora_rank = 0): set mla.kv_lora_rank > 0 "
                       "for multi-head latent attention, or leave the widths unset")
    if cfg.model.rope_scaling == "none":
        rope = [f"model.{n}" for n in _ROPE_FIELDS if getattr(cfg.model, n) != getattr(model_defaults, n)]
        if rope:
            out.append(f"{', '.join(rope)} set but model.rope_scaling = none: set model.rope_scaling yarn or llama3 "
                       "for them to apply, or leave them unset")
    if cfg.mtp.num_layers == 0 and cfg.mtp.loss_weight != mtp_defaults.loss_weight:
        out.append("mtp.loss_weight set but multi-token prediction is off (mtp.num_layers = 0): set mtp.num_layers "
                   ">= 1, or leave it unset")
    return out
