"""RoPE scaling between transformers' `rope_parameters` (or the older `rope_scaling`) and megalite's `model.rope_*`
fields (megalite/model/rope.py computes the scaled frequencies exactly as transformers does)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megalite.config.schema import ModelConfig
from megalite.errors import CheckpointError, one_line
from megalite.model.rope import RopeScaling, rope_scaling_problems

# model.rope_* <- transformers' rope_parameters keys (megalite/model/rope.py computes them as transformers does).
ROPE_KEYS = {"yarn": {"rope_factor": "factor", "rope_original_max_positions": "original_max_position_embeddings",
                      "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_mscale": "mscale",
                      "rope_mscale_all_dim": "mscale_all_dim", "rope_truncate": "truncate"},
             "llama3": {"rope_factor": "factor", "rope_original_max_positions": "original_max_position_embeddings",
                        "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor"}}


def rope_scaling_info(given: dict[str, Any], cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """The `model.rope_*` fields of an HF rope_parameters / rope_scaling object ({} for plain RoPE); refuses a
    scaling megalite does not compute (linear, dynamic, longrope, an explicit attention_factor)."""
    kind = given.get("rope_type", given.get("type", "default"))  # "type": legacy spelling
    if kind == "default":
        return {}
    if kind not in ROPE_KEYS or given.get("attention_factor") is not None:
        raise CheckpointError(f"this config cannot be imported: rope scaling {kind!r} ({key}) is not "
                              f"supported (megalite computes plain RoPE, {' and '.join(ROPE_KEYS)}; importing it "
                              "would be another model)")
    out: dict[str, Any] = {"rope_scaling": kind}
    try:
        for ours, theirs in ROPE_KEYS[kind].items():
            value = given.get(theirs)
            if theirs == "factor" and value is None and kind == "yarn":  # transformers' default: the length ratio
                value = cfg["max_position_embeddings"] / given["original_max_position_embeddings"]
            if ours == "rope_truncate":  # a flag (gpt-oss: false), not a number
                if not isinstance(value, (bool, type(None))):
                    raise TypeError(f"{theirs}={value!r} is not true or false")
                out[ours] = value is not False
            elif value is not None:
                if isinstance(value, (bool, str)):
                    raise TypeError(f"{theirs}={value!r} is not a number")
                out[ours] = int(value) if ours == "rope_original_max_positions" else float(value)
        scaling = RopeScaling.of(replace(ModelConfig(), **out))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"this config cannot be imported: rope scaling {kind!r} ({key}) is malformed: "
                              f"{one_line(str(e))}") from None
    if problems := rope_scaling_problems(scaling):
        raise CheckpointError(f"this config cannot be imported: {key}: {'; '.join(problems)}")
    return out


def hf_rope_parameters(info: dict[str, Any]) -> dict[str, Any]:
    """transformers' rope_parameters (less rope_theta) for a model's `rope_*` fields."""
    kind = info.get("rope_scaling", "none")
    if kind == "none":
        return {"rope_type": "default"}
    return {"rope_type": kind, **{theirs: info[ours] for ours, theirs in ROPE_KEYS[kind].items()
                                  if ours in info and not (theirs.startswith("mscale") and not info[ours])
                                  and not (theirs == "truncate" and info[ours])}}  # unset: transformers' true
