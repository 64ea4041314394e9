"""Typed run configuration: nested dataclasses, presets, TOML + `--section.field` CLI, validation.

One `Config` object describes a run. It is built by `parse_args` (or `config_from_dict`) with the
precedence

    dataclass defaults < model.preset < TOML file (--config) < command line

then `resolve(cfg, world_size)` fills the values that default to "derive me" (0 / None), and
`validate(cfg, world_size, device_type)` checks every rule at once, before any GPU time is spent,
and raises one `ConfigError` listing each problem with its fix. The rules are Megatron-core's
(world = tp*pp*dp, layers split evenly over stages, heads divisible by tp, global batch divisible
by micro-batch x dp) plus the most common pipeline configuration error: fewer
micro-batches than pipeline stages, where the pipeline spends most of its time idle
(bubble (P-1)/(M+P-1), Narayanan et al. 2021).

Each field's one-line doc lives in its `metadata["doc"]`, which `--help` prints.
"""

from megalite.config.derive import micro_batches_per_step, resolve, resolved_device, resolved_dtype
from megalite.config.parse import config_from_dict, config_to_dict, help_text, load_config, parse_args, save_config
from megalite.config.presets import PRESETS
from megalite.config.schema import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelArgs, ModelConfig,
                                    ParallelConfig, TrainConfig)
from megalite.config.validate import validate

__all__ = [
    "PRESETS", "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "ModelArgs", "ModelConfig",
    "ParallelConfig", "TrainConfig", "config_from_dict", "config_to_dict", "help_text", "load_config",
    "micro_batches_per_step", "parse_args", "resolve", "resolved_device", "resolved_dtype",
    "save_config", "validate",
]
