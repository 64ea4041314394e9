"""Megatron-LM checkpoints in: `torch_dist` (megatron-core's DCP layout) and legacy `mp_rank_XX[_YYY]` files.

Layouts read (a root with `latest_checkpointed_iteration.txt`, or an `iter_N` directory):

  torch_dist  iter_N/.metadata + __*_*.distcp (DCP), common.pt (the non-tensor state: `args`, iteration),
              metadata.json ({"sharded_backend": "torch_dist", ...}). Layer tensors are stacked over layers
              ("decoder.layers.self_attention.linear_qkv.weight" is [num_layers, rows, hidden]) and stored
              whole, independent of the saving TP x PP.
  legacy      iter_N/mp_rank_<tp>[_<pp>]/model_optim_rng.pt, one torch.save per (tp, pp) rank: {"args",
              "iteration", "model": that rank's shards, layers numbered from 0 on every stage}.

Model (megatron-core names -> megalite's; Llama-style = RMSNorm, SwiGLU, RoPE, no biases):

  embedding.word_embeddings.weight            embedding.weight   (padded vocab rows kept: vocab_size = padded)
  layers.i.self_attention.linear_qkv.weight   layers.i.attn.qkv.weight: Megatron interleaves by query group,
                                              [g: its q heads, k_g, v_g] -> megalite [q; k; v]. Both rotate
                                              halves in RoPE: no permutation.
  ...linear_qkv.layer_norm_weight | input_layernorm.weight          layers.i.norm1.weight
  ...self_attention.linear_proj.weight        layers.i.attn.out.weight
  ...linear_fc1.layer_norm_weight | pre_mlp_layernorm.weight        layers.i.norm2.weight
  ...mlp.linear_fc1.weight                    layers.i.mlp.up.weight: [gate; up] (each TP shard of a legacy
                                              file is [gate_r; up_r] and is regrouped)
  ...mlp.linear_fc2.weight                    layers.i.mlp.down.weight
  decoder.final_layernorm.weight              final_norm.weight
  output_layer.weight                         head.weight (absent when tied)

Pickles (common.pt, legacy files) are read with `torch.load(weights_only=True)` and only `argparse.Namespace`
(and megatron-core's enums, when it is installed) allowed: a file that needs any other class is refused with
one line naming it. The model's dims come from its `args`; MoE, multi-latent attention, vision towers and
GPT-style models (LayerNorm, GELU, biases, learned positions) are refused, naming what was found.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from megalite.checkpoint.dcp import load_tensor, read_metadata, tensor_shapes
from megalite.checkpoint.interop.source import Source
from megalite.errors import CheckpointError

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_UNSUPPORTED = (("num_experts", "mixture-of-experts layers (num_experts={})"),
                ("multi_latent_attention", "multi-latent attention (MLA)"),
                ("vision_model_type", "a vision tower ({})"))


def _allowed() -> list[Any]:
    allowed: list[Any] = [argparse.Namespace]
    try:  # args hold a few of megatron-core's enums; allowed by class, never by pattern
        from megatron.core.enums import ModelType  # type: ignore[import-untyped]
        from megatron.core.transformer.enums import AttnBackend, AttnMaskType  # type: ignore[import-untyped]

        allowed += [ModelType, AttnBackend, AttnMaskType]
    except ImportError:
        pass
    return allowed


def safe_load(path: Path) -> Any:
    """torch.load without running code from the file: weights_only with the allow-list above."""
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else str(e).splitlines()[0]
        raise CheckpointError(f"{path} needs the class {what} to be unpickled, which is not on the allow-list "
                              "(argparse.Namespace, megatron-core enums): refusing to run code from it") from e
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"cannot read {path} ({e}): the file is damaged or not a torch checkpoint") from e


def _iteration_dir(path: Path) -> Path:
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        path = path / name
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory: give a Megatron-LM checkpoint root or its iter_N directory")
    return path


def _arg(args: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        value = getattr(args, n, None)
        if value is not None:
            return value
    return default


def model_info(args: Any, src: Path, vocab_rows: int, tensor_names: list[str]) -> dict[str, Any]:
    """megalite's model dims from Megatron's args, refusing architectures megalite lacks."""
    for key, what in _UNSUPPORTED:
        value = getattr(args, key, None)
        if value:
            raise CheckpointError(f"{src}: the checkpoint has {what.format(value)}, which megalite does not have")
    vision = next((n for n in tensor_names if "vision" in n), None)
    if vision:
        raise CheckpointError(f"{src}: the checkpoint has a vision tower ({vision}), which megalite does not have")
    norm, swiglu = _arg(args, "normalization", default="LayerNorm"), bool(_arg(args, "swiglu", default=False))
    pos = _arg(args, "position_embedding_type", default="learned_absolute")
    if norm != "RMSNorm" or not swiglu or pos != "rope" or _arg(args, "add_bias_linear", default=True):
        raise CheckpointError(f"{src}: a GPT-style model (normalization={norm}, swiglu={swiglu}, position embedding "
                              f"{pos}, add_bias_linear={_arg(args, 'add_bias_linear', default=True)}): only Llama-style "
                              "Megatron models (RMSNorm, SwiGLU, RoPE, no biases) convert so far")
    heads = int(args.num_attention_heads)
    groups = int(_arg(args, "num_query_groups", default=heads)) if _arg(args, "group_query_attention") else heads
    return {"arch": "llama", "num_layers": int(args.num_layers), "hidden_size": int(args.hidden_size),
            "num_heads": heads, "num_kv_heads": groups, "ffn_hidden_size": int(args.ffn_hidden_size),
            "vocab_size": vocab_rows, "seq_len": int(_arg(args, "seq_length", "max_position_embeddings", default=2048)),
            "make_vocab_divisible_by": 1, "tie_embeddings": not bool(_arg(args, "untie_embeddings_and_output_weights",
                                                                           default=False)),
            "norm_eps": float(_arg(args, "norm_epsilon", default=1e-5)),
            "rope_theta": float(_arg(args, "rotary_base", default=10000))}


def ungroup_qkv(w: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """Megatron's [g: q heads of group g, k_g, v_g] rows -> megalite's [q; k; v]."""
    nh, ng = info["num_heads"], info["num_kv_heads"]
    hd = info["hidden_size"] // nh
    g = w.reshape(ng, nh // ng + 2, hd, w.shape[-1])
    return torch.cat([g[:, :-2].reshape(nh * hd, -1), g[:, -2].reshape(ng * hd, -1), g[:, -1].reshape(ng * hd, -1)])


_PER_LAYER = {"norm1.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
              "attn.qkv.weight": ("self_attention.linear_qkv.weight",),
              "attn.out.weight": ("self_attention.linear_proj.weight",),
              "norm2.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
              "mlp.up.weight": ("mlp.linear_fc1.weight",),
              "mlp.down.weight": ("mlp.linear_fc2.weight",)}


def _check_conflicts(src: Path, args: Any) -> None:
    """metadata.json and common.pt's args must agree on every field both hold."""
    meta = json.loads((src / "metadata.json").read_text())
    if meta.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"{src}/metadata.json: sharded_backend {meta.get('sharded_backend')!r}; only torch_dist "
                              "is read")
    content = dict(meta.get("content_metadata") or {}, **{k: v for k, v in meta.items() if k != "content_metadata"})
    clash = [f"{k}: metadata.json {v!r} vs common.pt args {getattr(args, k)!r}" for k, v in content.items()
             if hasattr(args, k) and getattr(args, k) != v]
    if clash:
        raise CheckpointError(f"{src}: metadata.json and common.pt disagree ({'; '.join(clash)}): the checkpoint "
                              "is inconsistent; not guessing which is right")


def _from_torch_dist(src: Path) -> Source:
    md = read_metadata(src)  # names a missing shard file
    common = safe_load(src / "common.pt")
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{src}/common.pt has no 'args': the model's dims are unknown")
    _check_conflicts(src, args)
    flat = tensor_shapes(md)
    info = model_info(args, src, flat["embedding.word_embeddings.weight"][0], list(flat))
    names = {"embedding.weight": "embedding.word_embeddings.weight", "final_norm.weight": "decoder.final_layernorm.weight"}
    if not info["tie_embeddings"]:
        names["head.weight"] = "output_layer.weight"
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
        mkey = next(f"decoder.layers.{c}" for c in _PER_LAYER[rest] if f"decoder.layers.{c}" in flat)
        t = stacked(mkey)[int(i)].clone()
        return ungroup_qkv(t, info) if rest == "attn.qkv.weight" else t

    shapes: dict[str, tuple[int, ...]] = {f"param/{n}": flat[m] for n, m in names.items()}
    for rest, candidates in _PER_LAYER.items():
        mkey = next((f"decoder.layers.{c}" for c in candidates if f"decoder.layers.{c}" in flat), None)
        if mkey is None:
            raise CheckpointError(f"{src}: no tensor decoder.layers.{candidates[0]} in the checkpoint")
        for i in range(info["num_layers"]):
            shapes[f"param/layers.{i}.{rest}"] = flat[mkey][1:]
    return Source(info, shapes, fetch, int(common.get("iteration", 0)))


def _merge_tp(rest: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if rest in ("norm1.weight", "norm2.weight"):
        return shards[0]
    if rest in ("attn.out.weight", "mlp.down.weight"):
        return torch.cat(shards, dim=1)
    if rest == "mlp.up.weight":  # every shard is [gate_r; up_r]
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards)  # qkv (whole query groups per rank), embedding / output rows


def _from_legacy(src: Path) -> Source:
    ranks: dict[tuple[int, int], Path] = {}
    for d in src.iterdir():
        m = _RANK_DIR.match(d.name)
        if m and d.is_dir():
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / "model_optim_rng.pt"
    tp, pp = 1 + max(t for t, _ in ranks), 1 + max(p for _, p in ranks)
    for t in range(tp):
        for p in range(pp):
            f = ranks.get((t, p), src / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")) / "model_optim_rng.pt")
            if not f.is_file():
                raise CheckpointError(f"{src}: {f.relative_to(src)} is missing (a {tp} x {pp} TP x PP checkpoint)")
            ranks[(t, p)] = f
    states = {k: safe_load(f) for k, f in sorted(ranks.items())}  # one full copy of the model in memory
    first = states[(0, 0)]
    args = first.get("args")
    if args is None:
        raise CheckpointError(f"{ranks[(0, 0)]} has no 'args': the model's dims are unknown")
    models = {k: v["model"] for k, v in states.items()}
    vocab = sum(models[(t, 0)]["embedding.word_embeddings.weight"].shape[0] for t in range(tp))
    info = model_info(args, src, vocab, [n for m in models.values() for n in m])
    per_stage = info["num_layers"] // pp
    full: dict[str, torch.Tensor] = {}
    full["param/embedding.weight"] = torch.cat([models[(t, 0)]["embedding.word_embeddings.weight"] for t in range(tp)])
    full["param/final_norm.weight"] = models[(0, pp - 1)]["decoder.final_layernorm.weight"]
    if not info["tie_embeddings"]:
        full["param/head.weight"] = torch.cat([models[(t, pp - 1)]["output_layer.weight"] for t in range(tp)])
    for p in range(pp):
        for local in range(per_stage):
            for rest, candidates in _PER_LAYER.items():
                key = next((f"decoder.layers.{local}.{c}" for c in candidates
                            if f"decoder.layers.{local}.{c}" in models[(0, p)]), None)
                if key is None:
                    raise CheckpointError(f"{ranks[(0, p)]}: no tensor decoder.layers.{local}.{candidates[0]}")
                merged = _merge_tp(rest, [models[(r, p)][key] for r in range(tp)]).float()
                full[f"param/layers.{p * per_stage + local}.{rest}"] = \
                    ungroup_qkv(merged, info) if rest == "attn.qkv.weight" else merged
    return Source(info, {k: tuple(v.shape) for k, v in full.items()}, lambda k: full[k].float(),
                  int(first.get("iteration", 0)))


def from_megatron(path: Path) -> Source:
    """A Megatron-LM checkpoint (root or iter_N; torch_dist or legacy) as megalite tensors (model weights)."""
    src = _iteration_dir(Path(path))
    if (src / "metadata.json").is_file() or (src / ".metadata").is_file():
        if not (src / "common.pt").is_file():
            raise CheckpointError(f"{src}: a torch_dist checkpoint without common.pt (the args): it is incomplete")
        if not (src / "metadata.json").is_file():
            raise CheckpointError(f"{src}: a torch_dist checkpoint without metadata.json: it is incomplete")
        return _from_torch_dist(src)
    if any(_RANK_DIR.match(d.name) for d in src.iterdir()):
        return _from_legacy(src)
    raise CheckpointError(f"{src} is neither a torch_dist checkpoint (metadata.json, .metadata) nor a legacy one "
                          "(mp_rank_XX/model_optim_rng.pt)")
