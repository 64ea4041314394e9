"""A saved model in one process, at whatever layout it was saved: the resharding loader reads each
parameter's full tensor (tp=1 view) from any tp/pp/dp/ZeRO checkpoint, or from an imported HF model.

The model's dims come from the checkpoint's index (`model`), so nothing has to be retyped; the tokenizer
is, in order: the one given, the run's `data.tokenizer` from the saved config, the demo tokenizer when
the run trained on the demo corpus, or the `tokenizer.json` of the HF directory it was imported from.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from megalite.checkpoint.layout import moe_from_info
from megalite.checkpoint.sharded import find, load_sharded, read_index
from megalite.config.schema import DataConfig, ModelArgs
from megalite.data.tokenizer import Tokenizer, load_tokenizer
from megalite.errors import CheckpointError, DataError
from megalite.mla.config import MLAConfig
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState


def model_config_from_info(info: dict[str, Any]) -> ModelArgs:
    """The model a checkpoint's recorded dims describe, its `[moe]` section included (torch kernels: generation
    runs the torch ops)."""
    cfg = ModelArgs(moe=moe_from_info(info), mla=mla_from_info(info) or MLAConfig())
    for key, value in info.items():
        if hasattr(cfg, key) and key not in ("moe", "mla", "mtp"):  # sections: read above (MTP: not for generation)
            setattr(cfg, key, value)
    cfg.kernels, cfg.dropout, cfg.recompute = "torch", 0.0, "none"
    return cfg


def mla_from_info(info: dict[str, Any]) -> MLAConfig | None:
    """The checkpoint's multi-head latent attention widths (`mla`, recorded when on), else None."""
    given = info.get("mla")
    if given is None:
        return None
    fields = {f.name for f in dataclasses.fields(MLAConfig)}
    if not isinstance(given, dict) or set(given) != fields or not all(type(v) is int for v in given.values()):
        raise CheckpointError(f"the checkpoint's model.mla {given!r} is not MLA's widths ({', '.join(sorted(fields))})")
    return MLAConfig(**given)


def load_model(checkpoint: str | Path, device: str = "cpu") -> tuple[GPT, dict[str, Any]]:
    """(model in eval mode on `device`, the checkpoint's index) from a checkpoint step dir or root."""
    path = find(str(checkpoint), "")
    if path is None:
        raise CheckpointError(f"--checkpoint {checkpoint}: give a checkpoint directory")
    index = read_index(path)
    if "model" not in index:
        raise CheckpointError(f"{path} records no model dims (written by an older megalite): nothing to build")
    state = ParallelState(device=torch.device(device))
    model = GPT(model_config_from_info(index["model"]), state, seed=0)
    load_sharded(path, model, None, state)
    return model.to(state.device).eval(), index


def tokenizer_for(index: dict[str, Any], given: str = "") -> Tokenizer:
    """The tokenizer of a checkpoint (see the module doc); a DataError saying what to pass if none is found."""
    if given:
        return load_tokenizer(given)
    extra = index.get("extra", {})
    config = extra.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    if isinstance(data, dict):
        if data.get("tokenizer"):
            return load_tokenizer(str(data["tokenizer"]))
        if not data.get("path"):  # the run trained on the demo corpus: its cached tokenizer, if still there
            return load_tokenizer(_cached_demo_tokenizer(data))
    source = extra.get("imported_from")
    if source and os.path.isfile(os.path.join(source, "tokenizer.json")):
        return load_tokenizer(source)
    raise DataError("the checkpoint does not say which tokenizer it was trained with: pass --tokenizer FILE")


def _cached_demo_tokenizer(data: dict[str, Any]) -> str:
    """The demo tokenizer the run trained with, from the cache its saved config names. Never built here:
    a tool that only reads a checkpoint writes nothing outside its own outputs (the saved cache_dir may be
    another user's directory, or a path that no longer means what it did)."""
    from megalite.data.demo import cached_demo_data

    defaults = DataConfig()
    cache_dir, max_bytes, vocab = (data.get("cache_dir", defaults.cache_dir),
                                   data.get("demo_max_bytes", defaults.demo_max_bytes),
                                   data.get("demo_vocab_size", defaults.demo_vocab_size))
    if not (isinstance(cache_dir, str) and type(max_bytes) is int and type(vocab) is int):
        raise DataError("the checkpoint's saved data settings are not a megalite config: pass --tokenizer FILE")
    found = cached_demo_data(cache_dir, max_bytes, vocab)
    if found is None:
        raise DataError(f"the checkpoint trained on the demo corpus (data.demo_max_bytes={max_bytes}, "
                        f"demo_vocab_size={vocab}) whose tokenizer is not in the cache {cache_dir or '(default)'}: "
                        "pass --tokenizer FILE, or rebuild it with a pretrain.py run of those settings")
    return found[1]


def check_vocab(model: GPT, tok: Tokenizer) -> None:
    """A tokenizer with more ids than the model's embedding would index past it: one clear line."""
    if tok.vocab_size > model.cfg.vocab_size:
        raise DataError(f"tokenizer {tok.path!r} has {tok.vocab_size} ids but the model's vocab_size is "
                        f"{model.cfg.vocab_size}: pass the tokenizer the model was trained with")
