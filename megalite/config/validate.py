"""Validation of a resolved megalite config: every rule in one place, all problems reported together.

Run before any process group, dataset or model exists, so a bad run fails before it costs anything.
`megalite.config.validate` is the public entry point. The rules live by concept: `values.py` (single values),
`layout.py` (shapes against the parallel layout), `environment.py` (where the run executes), and each feature's
own checks in its folder (`megalite/moe/config.py`, `megalite/optim/config.py`, `megalite/fp8/config.py`).
"""

from __future__ import annotations

from megalite.config import cli
from megalite.config.derive import resolve
from megalite.config.environment import compile_problems, environment_problems, path_problems
from megalite.config.layers import layer_problems
from megalite.config.layout import layout_problems, size_problems
from megalite.config.schema import Config, ModelArgs
from megalite.config.values import field_problems, finite_problems, maximum_problems, text_problems, value_problems
from megalite.fp8 import config as fp8_config
from megalite.moe import config as moe_config
from megalite.mla.config import mla_problems
from megalite.mtp.config import mtp_problems
from megalite.optim import config as optim_config


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
    problems += environment_problems(cfg, device_type)
    problems += field_problems(cfg)  # ranges read late in a run (values.py)
    problems += maximum_problems(cfg)  # upper bounds where an absurd value hangs or overflows (values.py)
    problems += fp8_config.problems(cfg.fp8, cfg.train.dtype, device_type)
    problems += fp8_config.layout_problems(cfg.fp8, ModelArgs.from_config(cfg), p.tp, p.cp)
    problems += compile_problems(cfg, device_type)
    cli.raise_if(problems, "invalid config")
