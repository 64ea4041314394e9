"""Reading a Hugging Face model directory's tensors: `model.safetensors` or a sharded set
(`model.safetensors.index.json`), one tensor at a time, every file name kept inside the directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from megalite.checkpoint.files import inside
from megalite.errors import CheckpointError, one_line
from megalite.untrusted import loads_json


def _opened(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path} ({one_line(str(e))}): not a complete safetensors file") from e


HF_WEIGHT_DTYPES = ("F32", "BF16", "F16")


def hf_tensor_source(hf_dir: Path) -> tuple[Callable[[str], torch.Tensor], Callable[[str], list[int]]]:
    """(name -> tensor, name -> shape) over model.safetensors or a sharded set (model.safetensors.index.json); accepts
    GPT-2 names with or without the `transformer.` prefix."""
    index_file = hf_dir / "model.safetensors.index.json"
    if index_file.exists():
        try:
            weight_map = loads_json(index_file.read_text(encoding="utf-8"), str(index_file),
                                    CheckpointError)["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the weight_map of {index_file} ({e!r})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_file}: weight_map must map tensor names to file names")
        for file in set(weight_map.values()):
            inside(hf_dir, file, "weight_map", links_out=True)  # refuse names that leave the directory before reading any
    elif (hf_dir / "model.safetensors").exists():
        with _opened(hf_dir / "model.safetensors") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise CheckpointError(f"{hf_dir} has no model.safetensors (or its index): export the HF model with "
                              "save_pretrained(..., safe_serialization=True)")
    handles: dict[str, Any] = {}

    def open_(name: str) -> tuple[Any, str]:
        key = name if name in weight_map else name.removeprefix("transformer.")
        if key not in weight_map:
            raise CheckpointError(f"{hf_dir} has no tensor {name}: the HF model is incomplete or of another kind")
        file = weight_map[key]
        if file not in handles:
            handles[file] = _opened(inside(hf_dir, file, "weight_map", links_out=True))
        return handles[file], key

    def get(name: str) -> torch.Tensor:
        handle, key = open_(name)
        dtype = handle.get_slice(key).get_dtype()
        if dtype in ("F8_E4M3", "U8"):  # as stored: a block-FP8 (hf_deepseek) or MXFP4 (hf_gpt_oss) reader
            return handle.get_tensor(key)  # dequantises it; import_hf refuses it as a weight
        if dtype not in HF_WEIGHT_DTYPES:  # an integer tensor read as weights would be a silent misread
            raise CheckpointError(f"{hf_dir}: tensor {key} is {dtype}; weights must be one of "
                                  f"{', '.join(HF_WEIGHT_DTYPES)}")
        return handle.get_tensor(key).float()

    def shape(name: str) -> list[int]:
        handle, key = open_(name)
        return list(handle.get_slice(key).get_shape())

    return get, shape
