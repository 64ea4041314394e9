"""A pretrain config (and the config's presets) as the estimator's inputs: model dims, layout fields, dtype and
the feature settings `tools/estimate.py` and `tools/plan.py` price, torch-free (torch is asked only to resolve a
dtype of `auto`). The tools' flags win over these; the argument parsing stays in the tools."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

from megalite.errors import ConfigError
from megalite.mla.costs import MLADims
from megalite.model.pattern import LINEAR, layer_specs, linear_dims
from megalite.model.spec import ModelSpec
from megalite.moe.config import MoEConfig
from megalite.perfmodel.estimate import PRESETS
from megalite.perfmodel.inputs import ModelDims, MoEDims

# The model flags the tools share (config names; --preset fills them too).
MODEL_FLAGS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
               "vocab_size", "seq_len", "head_dim", "mtp_layers")


def _model_dims_kwargs(model: object, demo_vocab: int | None) -> dict:
    """ModelDims keywords from a config `model` section; its "derive me" zeros become None (the
    same defaults), and an unset vocabulary (taken from the tokenizer at run time) the demo one."""
    get = (model.get if isinstance(model, dict) else lambda k, d=None: getattr(model, k, d))
    dims = {k: get(k) or None for k in MODEL_FLAGS}
    dims["vocab_size"] = dims["vocab_size"] or demo_vocab
    dims["tie_embeddings"] = get("tie_embeddings")
    dims["make_vocab_divisible_by"] = get("make_vocab_divisible_by") or 1
    return dims


def moe_dims(num_layers: int, ffn_hidden_size: int, moe: MoEConfig) -> MoEDims | None:
    """The perfmodel's view of a model's experts (None for a dense model), read from its `[moe]` section alone;
    `ffn_hidden_size` is the model's resolved MLP width (the experts' default)."""
    s = moe.resolved(ffn_hidden_size)
    if s is None:
        return None
    return MoEDims(experts=s.experts, ffn=s.ffn_hidden_size, layers=tuple(s.layers(num_layers)), top_k=s.top_k,
                   shared=s.shared_experts, shared_ffn=s.shared_ffn_hidden_size)


def spec_dims(m: ModelSpec) -> ModelDims:
    """The perfmodel's view of a resolved model config (`megalite.config.ModelArgs`, `ModelSpec`): its shape, MLA,
    MTP depth and experts; the check before step 1 and the MoE planner read a model through this one function."""
    return ModelDims(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                     vocab_size=m.vocab_size, seq_len=m.seq_len, arch=m.arch, num_kv_heads=m.num_kv_heads or None,
                     ffn_hidden_size=m.ffn_hidden_size or None, tie_embeddings=m.tie_embeddings,
                     make_vocab_divisible_by=m.make_vocab_divisible_by or 1, head_dim=m.head_dim or None,
                     mla=MLADims.of(m.mla), mtp_layers=m.mtp.num_layers,
                     moe=moe_dims(m.num_layers, m.ffn_hidden_size, m.moe), **pattern_fields(m))


def layer_windows(m: object) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (megalite/model/pattern.py) when some layer has one, else None (all full)."""
    windows = tuple(spec.window for spec in layer_specs(m))
    return windows if any(w is not None for w in windows) else None


def pattern_fields(m: object) -> dict:
    """ModelDims' layer-pattern fields of model config `m` (megalite/model/pattern.py): each layer's sliding window
    (`layer_windows`), the linear_attention layers and their shape."""
    linear = tuple(i for i, spec in enumerate(layer_specs(m)) if spec.mixer == LINEAR)
    heads, hidden = getattr(m, "num_heads"), getattr(m, "hidden_size")
    shape = linear_dims(m, getattr(m, "head_dim") or hidden // heads) if linear else None
    return {"windows": layer_windows(m), "linear_layers": linear, "linear": shape}


def _resolved_dims(kwargs: dict) -> ModelDims:
    """ModelDims of keywords where None means "the default" (as the tools pass them on)."""
    return ModelDims(**{k: v for k, v in kwargs.items() if v is not None})


def presets() -> dict[str, dict]:
    """`megalite.perfmodel.estimate.PRESETS`, overridden by `megalite.config.PRESETS` (the sizes pretrain.py
    knows) when that module is importable."""
    table = {name: dict(vars(d)) for name, d in PRESETS.items()}
    try:
        from megalite.config import PRESETS as CONFIG_PRESETS, DataConfig, ModelConfig
        from megalite.config.presets import section_values
        from megalite.mla.config import MLAConfig
    except ImportError:
        return table
    for name, values in CONFIG_PRESETS.items():
        model = {**asdict(ModelConfig()), **section_values(values)}
        table[name] = _model_dims_kwargs(model, DataConfig().demo_vocab_size)
        table[name].update(pattern_fields(SimpleNamespace(**model)))  # gpt-oss, Gemma 3, Qwen3.5: their layer pattern
        if mla := section_values(values, "mla"):  # deepseek-v3: its attention and MTP modules, as a --config's
            table[name]["mla"] = MLADims.of(MLAConfig(**mla))
        table[name]["mtp_layers"] = section_values(values, "mtp").get("num_layers")
        if moe := section_values(values, "moe"):  # the experts: the peak memory model sizes them (docs/estimator.md)
            width = _resolved_dims(table[name]).ffn
            table[name]["moe"] = moe_dims(table[name]["num_layers"], width, MoEConfig(**moe))
    return table


# The feature settings a config gives the estimate (each a flag of the same name, which wins) and their defaults.
FEATURE_DEFAULTS = {"fp8": "none", "fp8_min_dim": 128, "optimizer": "adamw", "muon_ns_steps": 5}


def from_config(config_argv: list[str]) -> tuple[dict, dict, str | None, dict]:
    """Model dims, layout fields, dtype and the feature settings (`FEATURE_DEFAULTS`' keys) from a pretrain
    config (the public config field names), whose `[moe]`, `[fp8]`, `[optimizer]` and `[muon]` sections are
    checked by the features' own rules first (what the run would refuse is not priced: experts -4 would be a
    negative parameter count). Unresolved values (dp = 0: world size unknown here, global batch 0) fall back
    to the flags' defaults: pass --dp to size the data-parallel group."""
    try:
        from megalite.config import parse_args
        from megalite.config.cli import raise_if
        from megalite.fp8 import config as fp8_config
        from megalite.moe import config as moe_config
        from megalite.optim import config as optim_config
    except ImportError as exc:
        raise ConfigError(f"--config needs megalite.config ({exc}); pass the model and layout "
                          f"as explicit flags instead (see --help)") from exc
    cfg = parse_args(config_argv)
    model, par, train = cfg.model, cfg.parallel, cfg.train
    raise_if(moe_config.problems(cfg.moe, model.num_layers, model.ffn_hidden_size, par.tp, par.dp, par.cp, par.ep)
             + fp8_config.section_problems(cfg.fp8) + optim_config.problems(cfg.optimizer, cfg.muon), "invalid config")
    features = {"fp8": cfg.fp8.recipe, "fp8_min_dim": cfg.fp8.min_dim, "optimizer": cfg.optimizer.name,
                "muon_ns_steps": cfg.muon.ns_steps}
    data = cfg.data
    demo_vocab = data.demo_vocab_size if not data.tokenizer else None
    dims = _model_dims_kwargs(model, demo_vocab)
    dims["mla"] = MLADims.of(cfg.mla)  # multi-head latent attention's widths (None when off)
    dims["mtp_layers"] = cfg.mtp.num_layers or None
    dims["moe"] = moe_dims(model.num_layers, _resolved_dims(dims).ffn, cfg.moe)
    dims.update(pattern_fields(model))  # the layer pattern: sliding windows, linear_attention layers
    lay = {k: getattr(par, k) or None for k in ("tp", "pp", "dp", "vpp", "schedule", "sp", "cp", "cp_mode", "cp_a2a")}
    lay.update(zero=par.zero, document_mask=data.document_mask, micro_batch_size=train.micro_batch_size or None,
               global_batch_size=train.global_batch_size or None, recompute=model.recompute)
    return dims, lay, _config_dtype(train.dtype, train.device), features


def _config_dtype(dtype: str | None, device: str | None) -> str | None:
    """The dtype the run uses, as pretrain.py resolves `auto`: bf16 on CUDA, fp32 on CPU (for
    device auto: whichever this machine has)."""
    if dtype != "auto":
        return dtype
    if device == "auto":
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cuda"
    return "bf16" if device == "cuda" else "fp32"
