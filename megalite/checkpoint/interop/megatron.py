"""Megatron-LM checkpoints in: `torch_dist` (megatron-core's DCP layout) and legacy `mp_rank_XX[_YYY]` files.

Layouts read (a root with `latest_checkpointed_iteration.txt`, or an `iter_N` directory):

  torch_dist  iter_N/.metadata + __*_*.distcp (DCP), common.pt (the non-tensor state: `args`, iteration),
              metadata.json ({"sharded_backend": "torch_dist", ...}). Layer tensors are stacked over layers
              ("decoder.layers.self_attention.linear_qkv.weight" is [num_layers, rows, hidden]) and stored
              whole, independent of the saving TP x PP.
  legacy      iter_N/mp_rank_<tp>[_<pp>]/model_optim_rng.pt, one torch.save per (tp, pp) rank: {"args",
              "iteration", "model": that rank's shards, layers numbered from 0 on every stage}
              (read by `megatron_legacy`).

Every declared dim is checked against the tensors and every flag's type before anything is written
(`megatron_checks`); optimizer state is refused unless --weights-only (it is not converted).

Model (megatron-core names -> megalite's). Llama-style (RMSNorm, SwiGLU, RoPE, no biases) -> arch llama;
GPT-2-style (LayerNorm with bias, tanh GeLU, learned absolute positions, biases in every linear) -> arch gpt2:

  embedding.word_embeddings.weight            embedding.weight   (padded vocab rows kept: vocab_size = padded)
  layers.i.self_attention.linear_qkv.weight   layers.i.attn.qkv.weight: Megatron interleaves by query group,
                                              [g: its q heads, k_g, v_g] -> megalite [q; k; v]. Both rotate
                                              halves in RoPE: no permutation.
  ...linear_qkv.layer_norm_weight | input_layernorm.weight          layers.i.norm1.weight
  ...self_attention.linear_proj.weight        layers.i.attn.out.weight
  ...linear_fc1.layer_norm_weight | pre_mlp_layernorm.weight        layers.i.norm2.weight
  ...mlp.linear_fc1.weight                    layers.i.mlp.up.weight: llama [gate; up] (each TP shard of a
                                              legacy file is [gate_r; up_r] and is regrouped); gpt2 as is
  ...mlp.linear_fc2.weight                    layers.i.mlp.down.weight
  decoder.final_layernorm.weight              final_norm.weight
  output_layer.weight                         head.weight (absent when tied)
  gpt2 only: embedding.position_embeddings.weight -> position (its rows are seq_len); each norm's and linear's
  `.bias` beside its weight (`layer_norm_bias` | `input_layernorm.bias` ...), the QKV bias ungrouped like its
  weight; in legacy files the row-parallel biases (linear_proj, linear_fc2) are whole on every TP rank.

Pickles (common.pt, legacy files) are read with `torch.load(weights_only=True)` and only `argparse.Namespace`,
numpy's array reconstruction (the RNG states) and megatron-core's enums (when it is installed) allowed: a file
that needs any other class is refused with one line naming it. The model's dims come from its `args`; MoE, multi-latent attention, vision towers, the erf
GeLU, and options megalite's layers lack (post-norm residuals, zero-centred norms, QK norms, ...) are refused,
naming what was found.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from megalite.checkpoint.interop.dcp import load_tensor, read_metadata, tensor_shapes
from megalite.checkpoint.interop.megatron_checks import (check_shape, check_tied_head, layer_shapes,
                                                         leftover_tensors, top_shapes)
from megalite.checkpoint.interop.megatron_legacy import from_legacy
from megalite.checkpoint.interop.megatron_model import (RANK_DIR, check_core_names, iteration, model_info,
                                                        per_layer_names, safe_load, top_level, ungroup_qkv)
from megalite.checkpoint.interop.source import Source
from megalite.errors import CheckpointError
from megalite.untrusted import load_json_file


def _iteration_dir(path: Path) -> Path:
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text != "release" and not (text.isascii() and text.isdigit()):
            raise CheckpointError(f"{tracker} holds {text[:40]!r}: Megatron-LM writes an iteration number or "
                                  "'release' there; fix it or give the iter_N directory")
        path = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory: give a Megatron-LM checkpoint root or its iter_N directory")
    return path


def _check_conflicts(src: Path, args: Any) -> None:
    """metadata.json and common.pt's args must agree on every field both hold."""
    meta = load_json_file(src / "metadata.json", f"{src}/metadata.json", CheckpointError)
    if not isinstance(meta, dict) or not isinstance(meta.get("content_metadata") or {}, dict):
        raise CheckpointError(f"{src}/metadata.json is not a JSON object of Megatron's checkpoint metadata")
    if meta.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"{src}/metadata.json: sharded_backend {meta.get('sharded_backend')!r}; only torch_dist "
                              "is read")
    content = dict(meta.get("content_metadata") or {}, **{k: v for k, v in meta.items() if k != "content_metadata"})
    clash = [f"{k}: metadata.json {v!r} vs common.pt args {getattr(args, k)!r}" for k, v in content.items()
             if hasattr(args, k) and getattr(args, k) != v]
    if clash:
        raise CheckpointError(f"{src}: metadata.json and common.pt disagree ({'; '.join(clash)}): the checkpoint "
                              "is inconsistent; not guessing which is right")


def _from_torch_dist(src: Path, weights_only: bool) -> Source:
    md = read_metadata(src)  # names a missing shard file
    common = safe_load(src / "common.pt")
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{src}/common.pt has no 'args' (Megatron-LM's argparse.Namespace): the model's dims "
                              "are unknown")
    _check_conflicts(src, args)
    flat = tensor_shapes(md)
    pos = flat.get("embedding.position_embeddings.weight")
    check_core_names(src, list(flat))
    info = model_info(args, src, flat["embedding.word_embeddings.weight"][0], list(flat), pos[0] if pos else None)
    names = top_level(info)
    missing = next((m for m in names.values() if m not in flat), None)
    if missing:
        raise CheckpointError(f"{src}: no tensor {missing} in the checkpoint")
    tops = top_shapes(info)
    for n, m in names.items():
        check_shape(src, m, flat[m], tops[n])
    used = set(names.values())
    if info["tie_embeddings"] and "output_layer.weight" in flat:  # a tied head saved anyway: it must be the embedding
        check_tied_head(src, info, load_tensor(src, ["output_layer.weight"], flat["output_layer.weight"]),
                        load_tensor(src, [names["embedding.weight"]], flat[names["embedding.weight"]]))
        used.add("output_layer.weight")
    per_layer = per_layer_names(info)
    cache: dict[str, torch.Tensor] = {}

    def stacked(key: str) -> torch.Tensor:  # one [num_layers, ...] tensor, kept while its layers are fetched
        if key not in cache:
            cache.clear()
            cache[key] = load_tensor(src, [key], flat[key])
        return cache[key]

    def fetch(key: str) -> torch.Tensor:
        name = key.split("/", 1)[1]
        if name in names:
            return load_tensor(src, [names[name]], flat[names[name]])
        _, i, rest = name.split(".", 2)
        mkey = next(f"decoder.layers.{c}" for c in per_layer[rest] if f"decoder.layers.{c}" in flat)
        t = stacked(mkey)[int(i)].clone()
        return ungroup_qkv(t, info) if rest.startswith("attn.qkv.") else t

    shapes: dict[str, tuple[int, ...]] = {f"param/{n}": flat[m] for n, m in names.items()}
    for rest, candidates in per_layer.items():
        mkey = next((f"decoder.layers.{c}" for c in candidates if f"decoder.layers.{c}" in flat), None)
        if mkey is None:
            raise CheckpointError(f"{src}: no tensor decoder.layers.{candidates[0]} in the checkpoint")
        if not flat[mkey] or flat[mkey][0] != info["num_layers"]:  # stacked over the layers: [num_layers, ...]
            raise CheckpointError(f"{src}: {mkey} holds {flat[mkey][0] if flat[mkey] else 0} layers but args.num_layers is "
                                  f"{info['num_layers']}: the checkpoint is inconsistent; not guessing which is right")
        check_shape(src, f"{mkey} (one layer of it)", flat[mkey][1:], layer_shapes(info)[rest])
        used.add(mkey)
        for i in range(info["num_layers"]):
            shapes[f"param/layers.{i}.{rest}"] = flat[mkey][1:]
    dropped = leftover_tensors(src, list(flat), used, weights_only)
    return Source(info, shapes, fetch, iteration(common, src / "common.pt"), dropped=dropped)


def from_megatron(path: Path, weights_only: bool = False) -> Source:
    """A Megatron-LM checkpoint (root or iter_N; torch_dist or legacy) as megalite tensors (model weights;
    optimizer state is refused unless `weights_only`)."""
    src = _iteration_dir(Path(path))
    if (src / "metadata.json").is_file() or (src / ".metadata").is_file():
        if not (src / "common.pt").is_file():
            raise CheckpointError(f"{src}: a torch_dist checkpoint without common.pt (the args): it is incomplete")
        if not (src / "metadata.json").is_file():
            raise CheckpointError(f"{src}: a torch_dist checkpoint without metadata.json: it is incomplete")
        return _from_torch_dist(src, weights_only)
    if any(RANK_DIR.match(d.name) for d in src.iterdir()):
        return from_legacy(src, weights_only)
    raise CheckpointError(f"{src} is neither a torch_dist checkpoint (metadata.json, .metadata) nor a legacy one "
                          "(mp_rank_XX/model_optim_rng.pt)")
