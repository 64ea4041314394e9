"""Checks of metadata that comes from outside megalite's own writers: a checkpoint's `index.json`
(possibly hand-edited or from another tool) and the model dimensions taken from an HF `config.json`.

Everything a reader later indexes, divides by or joins to a path is checked here, up front, so a
foreign or edited file gives one CheckpointError naming the field instead of a KeyError/TypeError
deep in a loader, or, worse, a converted checkpoint that cannot be loaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megalite.config.cli import coerce, field_types
from megalite.config.layers import variant_info_problems
from megalite.errors import CheckpointError, ConfigError
from megalite.moe import config as moe_config

_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
_OPTIONAL_DIMS = ("seq_len", "make_vocab_divisible_by")  # recorded by megalite, absent in older files
_ARCHS = ("llama", "gpt2")
# Far beyond any real model, small enough that nothing sized from them overflows or allocates absurdly
# (a vocab_size of 1e10 would be a 10^10-row embedding; a token id must fit the data's uint32).
MAX_DIM = {"num_layers": 100_000, "hidden_size": 2**20, "num_heads": 2**16, "num_kv_heads": 2**16,
           "ffn_hidden_size": 2**22, "vocab_size": 2**32, "seq_len": 2**24, "make_vocab_divisible_by": 2**16}
MAX_COUNT = 2**62  # steps, samples: a counter no run reaches, and that stays exact in float64 arithmetic


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any, n: int | None = None, minimum: int = 0) -> bool:
    return (isinstance(x, list) and (n is None or len(x) == n)
            and all(_is_int(v) and v >= minimum for v in x))


def model_info_problems(info: Any) -> list[str]:
    """What is wrong with a model-dims dict (as stored in index.json "model"), one phrase each."""
    if not isinstance(info, dict):
        return [f"model dims are a {type(info).__name__}, not an object"]
    out = [f"{k}={info.get(k)!r} must be an integer in [1, {MAX_DIM[k]}]" for k in _DIMS + _OPTIONAL_DIMS
           if (k in _DIMS or k in info) and not (_is_int(info.get(k)) and 1 <= info[k] <= MAX_DIM[k])]
    hd = info.get("head_dim")  # recorded only where set apart from hidden / heads (Qwen3)
    if hd is not None and not (_is_int(hd) and 2 <= hd <= MAX_DIM["num_heads"] and hd % 2 == 0):
        out.append(f"head_dim={hd!r} must be an even integer in [2, {MAX_DIM['num_heads']}]")
    if info.get("arch") not in _ARCHS:
        out.append(f"arch={info.get('arch')!r} must be one of {', '.join(_ARCHS)}")
    if not isinstance(info.get("tie_embeddings"), bool):
        out.append(f"tie_embeddings={info.get('tie_embeddings')!r} must be true or false")
    for k in ("norm_eps", "rope_theta"):
        v = info.get(k)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            out.append(f"{k}={v!r} must be a positive finite number")
    if "qk_norm" in info and not isinstance(info["qk_norm"], bool):
        out.append(f"qk_norm={info['qk_norm']!r} must be true or false")
    if out:
        return out
    out += moe_info_problems(info) + variant_info_problems(info)
    h, nh, nkv = info["hidden_size"], info["num_heads"], info["num_kv_heads"]
    if h % nh:
        out.append(f"hidden_size={h} is not divisible by num_heads={nh}")
    if nh % nkv:
        out.append(f"num_heads={nh} is not divisible by num_kv_heads={nkv}")
    return out


def moe_info_problems(info: dict[str, Any]) -> list[str]:
    """A MoE model's routing as recorded ("moe_" + each `[moe]` field), checked with the SAME types and rules as
    the `[moe]` config section (`megalite.moe.config.problems`), so no reader builds a model the config would
    refuse. Parallel sizes are 1: how a checkpoint is sharded is checked against its tensors, not here."""
    values: dict[str, Any] = {}
    out: list[str] = []
    for name, tp in field_types(moe_config.MoEConfig).items():
        if f"moe_{name}" in info:
            try:
                values[name] = coerce(f"moe_{name}", info[f"moe_{name}"], tp, from_cli=False)
            except ConfigError as e:  # a string for an int, a bool for an int, ...
                out.append(str(e))
    if out or not values:
        return out
    moe = moe_config.MoEConfig(**values)
    return moe_config.problems(moe, info["num_layers"], info["ffn_hidden_size"], tp=1, dp=1, cp=1, ep=1)


def _tensor_problems(index: dict[str, Any]) -> list[str]:
    tensors, files = index["tensors"], index["files"]
    for key, entry in tensors.items():
        if not isinstance(entry, dict) or not _ints(entry.get("shape"), minimum=1):
            return [f"tensor {key!r} has no valid shape"]
        if entry.get("dtype", "float32") != "float32":
            return [f"tensor {key!r} has dtype {entry.get('dtype')!r}; megalite checkpoints store float32"]
        rank = len(entry["shape"])
        slabs = entry.get("slabs")
        if not isinstance(slabs, list) or not slabs:
            return [f"tensor {key!r} has no slabs"]
        for slab in slabs:
            if not (isinstance(slab, dict) and isinstance(slab.get("key"), str)
                    and _ints(slab.get("offset"), rank) and _ints(slab.get("shape"), rank, minimum=1)):
                return [f"tensor {key!r} has a malformed slab {slab!r}"]
            if slab.get("file") not in files:
                return [f"tensor {key!r} is read from {slab.get('file')!r}, which has no sha256 in 'files'"]
            if any(o + n > g for o, n, g in zip(slab["offset"], slab["shape"], entry["shape"])):
                return [f"tensor {key!r} has a slab outside its shape {entry['shape']}"]
    return []


def _extra_problems(extra: dict[str, Any]) -> list[str]:
    """The training state a resume restores: the sampler position and the fp16 loss scaler."""
    out: list[str] = []
    sampler = extra.get("sampler")
    if sampler is not None and not (
            isinstance(sampler, dict) and _is_int(sampler.get("consumed_samples"))
            and 0 <= sampler["consumed_samples"] <= MAX_COUNT
            and all(_is_int(sampler[k]) and 0 <= sampler[k] < 2**64 for k in ("seed", "dataset_len") if k in sampler)):
        out.append(f"extra.sampler={sampler!r} needs an integer consumed_samples in [0, 2^62] (and integer seed, "
                   "dataset_len in [0, 2^64) if given)")
    scaler = extra.get("scaler")
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
                                   and math.isfinite(scaler["scale"]) and scaler["scale"] > 0
                                   and _is_int(scaler.get("good_steps"))):
        out.append(f"extra.scaler={scaler!r} needs a positive finite scale and an integer good_steps")
    return out


def _rng_problems(index: dict[str, Any]) -> list[str]:
    """Per-rank RNG states: tensor names and file names (a file is verified against 'files' when read)."""
    keys, files = index.get("rng_keys", []), index.get("rng_files", {})
    if not isinstance(keys, list) or not isinstance(files, dict):
        return []  # reported with the other container types
    out = []
    if not all(isinstance(k, str) and k for k in keys):
        out.append(f"rng_keys={keys!r} must be tensor names")
    if not all(isinstance(r, str) and r.isdigit() and isinstance(f, str) for r, f in files.items()):
        out.append(f"rng_files={files!r} must map rank numbers to file names")  # each verified when read
    return out


def check_index(index: dict[str, Any], path: Path) -> None:
    """Raise one CheckpointError listing what makes `index` (a parsed index.json) unusable."""
    problems: list[str] = []
    if not (_is_int(index.get("step")) and 0 <= index["step"] <= MAX_COUNT):
        problems.append(f"step={index.get('step')!r} must be an integer in [0, 2^62]")
    if not isinstance(index.get("files"), dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in index["files"].items()):
        problems.append("'files' must map each file name to its sha256")
    if not isinstance(index.get("tensors"), dict) or not index["tensors"]:
        problems.append("'tensors' must list the stored tensors")
    for key, kind in (("extra", dict), ("layout", dict), ("rng_files", dict), ("rng_keys", list)):
        if key in index and not isinstance(index[key], kind):
            problems.append(f"'{key}' must be a JSON {'object' if kind is dict else 'list'}")
    problems += _rng_problems(index)
    opt = index.get("optimizer_step")
    if opt is not None and not (isinstance(opt, (int, float)) and math.isfinite(opt) and opt >= 0):
        problems.append(f"optimizer_step={opt!r} must be a number >= 0")
    problems += [f"model: {p}" for p in model_info_problems(index.get("model"))]
    if isinstance(index.get("extra"), dict):
        problems += _extra_problems(index["extra"])
    if not problems:
        problems += _tensor_problems(index)
    if problems:
        raise CheckpointError(f"{path / 'index.json'} is not a valid megalite index ({'; '.join(problems)}): it was "
                              "edited or written by another tool; load an earlier checkpoint or re-save it")
