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

from megalite.errors import CheckpointError

_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
_ARCHS = ("llama", "gpt2")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any, n: int | None = None, minimum: int = 0) -> bool:
    return (isinstance(x, list) and (n is None or len(x) == n)
            and all(_is_int(v) and v >= minimum for v in x))


def model_info_problems(info: Any) -> list[str]:
    """What is wrong with a model-dims dict (as stored in index.json "model"), one phrase each."""
    if not isinstance(info, dict):
        return [f"model dims are a {type(info).__name__}, not an object"]
    out = [f"{k}={info.get(k)!r} must be a positive integer" for k in _DIMS
           if not (_is_int(info.get(k)) and info[k] >= 1)]
    if info.get("arch") not in _ARCHS:
        out.append(f"arch={info.get('arch')!r} must be one of {', '.join(_ARCHS)}")
    if not isinstance(info.get("tie_embeddings"), bool):
        out.append(f"tie_embeddings={info.get('tie_embeddings')!r} must be true or false")
    for k in ("norm_eps", "rope_theta"):
        v = info.get(k)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            out.append(f"{k}={v!r} must be a positive finite number")
    if out:
        return out
    h, nh, nkv = info["hidden_size"], info["num_heads"], info["num_kv_heads"]
    if h % nh:
        out.append(f"hidden_size={h} is not divisible by num_heads={nh}")
    if nh % nkv:
        out.append(f"num_heads={nh} is not divisible by num_kv_heads={nkv}")
    return out


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
            isinstance(sampler, dict) and _is_int(sampler.get("consumed_samples")) and sampler["consumed_samples"] >= 0
            and all(_is_int(sampler[k]) and sampler[k] >= 0 for k in ("seed", "dataset_len") if k in sampler)):
        out.append(f"extra.sampler={sampler!r} needs an integer consumed_samples >= 0 (and integer seed, "
                   "dataset_len if given)")
    scaler = extra.get("scaler")
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
                                   and math.isfinite(scaler["scale"]) and scaler["scale"] > 0
                                   and _is_int(scaler.get("good_steps"))):
        out.append(f"extra.scaler={scaler!r} needs a positive finite scale and an integer good_steps")
    return out


def check_index(index: dict[str, Any], path: Path) -> None:
    """Raise one CheckpointError listing what makes `index` (a parsed index.json) unusable."""
    problems: list[str] = []
    if not (_is_int(index.get("step")) and index["step"] >= 0):
        problems.append(f"step={index.get('step')!r} must be an integer >= 0")
    if not isinstance(index.get("files"), dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in index["files"].items()):
        problems.append("'files' must map each file name to its sha256")
    if not isinstance(index.get("tensors"), dict) or not index["tensors"]:
        problems.append("'tensors' must list the stored tensors")
    for key, kind in (("extra", dict), ("layout", dict), ("rng_files", dict), ("rng_keys", list)):
        if key in index and not isinstance(index[key], kind):
            problems.append(f"'{key}' must be a JSON {'object' if kind is dict else 'list'}")
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
