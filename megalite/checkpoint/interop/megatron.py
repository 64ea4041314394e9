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
import enum
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megalite.checkpoint.dcp import load_tensor, read_metadata, tensor_shapes
from megalite.checkpoint.interop.megatron_checks import (check_shape, check_tied_head, layer_shapes,
                                                         leftover_tensors, top_shapes)
from megalite.checkpoint.interop.source import Source
from megalite.errors import CheckpointError
from megalite.untrusted import load_json_file

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_UNSUPPORTED = (("multi_latent_attention", "multi-latent attention (MLA)"),
                ("vision_model_type", "a vision tower ({})"))


def _allowed() -> list[Any]:
    # Legacy files hold Megatron's RNG states, numpy's among them (`np.random.get_state()`: a uint32 array):
    # numpy's array reconstruction rebuilds an array from its bytes and dtype, and runs nothing else.
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    allowed: list[Any] = [argparse.Namespace, _reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:  # args hold megatron-core's enums (model_type, attention_backend, fp8_recipe, cuda_graph_scope, ...):
        # every Enum class its two enum modules define, by class (unpickling an Enum only looks a member up).
        # Importing megatron-core on a machine without Transformer Engine / Apex warns four times that it falls
        # back to torch's kernels: nothing a conversion uses, and it would bury a one-line refusal.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
            import megatron.core.enums as core_enums  # type: ignore[import-untyped]
            import megatron.core.transformer.enums as transformer_enums  # type: ignore[import-untyped]
    except ImportError:
        return allowed
    for module in (core_enums, transformer_enums):
        allowed += [v for v in vars(module).values()
                    if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__]
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
                              "(argparse.Namespace, megatron-core enums, numpy arrays): refusing to run code from it") from e
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"cannot read {path} ({e}): the file is damaged or not a torch checkpoint") from e


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


def _arg(args: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        value = getattr(args, n, None)
        if value is not None:
            return value
    return default


def _flag(args: Any, name: str, default: bool = False) -> bool:
    """A boolean field of `args`: a crafted or hand-edited file's "false" (a string, which is truthy) or 0 is
    refused, not read as a switch."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"the checkpoint's args.{name} is {value!r}, not True or False: the model's "
                              "structure is unknown (the file is damaged or crafted)")
    return value


def _number(args: Any, name: str, default: float) -> float:
    """A positive finite number field of `args` (a string "1e-5" is not one)."""
    value = getattr(args, name, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise CheckpointError(f"the checkpoint's args.{name} is {value!r}, not a positive number: the file is "
                              "damaged or crafted")
    return float(value)


# Megatron-LM options that change what the model computes in ways megalite's layers do not: refused, by name.
_UNMODELLED = (("apply_residual_connection_post_layernorm", "residuals taken after the norm"),
               ("apply_layernorm_1p", "zero-centred norm weights (apply_layernorm_1p)"),
               ("layernorm_zero_centered_gamma", "zero-centred norm weights (layernorm_zero_centered_gamma)"),
               ("qk_layernorm", "query/key norms (qk_layernorm)"),
               ("rotary_interleaved", "interleaved RoPE (rotary_interleaved)"),
               ("use_rope_scaling", "RoPE frequency scaling (use_rope_scaling)"),
               ("squared_relu", "a squared-ReLU MLP"), ("onnx_safe", "the exact (erf) GeLU of onnx_safe"),
               ("window_size", "sliding-window attention (window_size)"), ("qk_l2_norm", "query/key L2 norms"),
               ("attention_output_gate", "a gated attention output"),
               ("mtp_num_layers", "multi-token prediction layers (mtp_num_layers)"),
               ("hybrid_override_pattern", "Mamba / hybrid layers (hybrid_override_pattern)"))


def _family(args: Any, src: Path) -> str:
    """'llama' (RMSNorm, SwiGLU, RoPE, no biases) or 'gpt2' (LayerNorm, tanh GeLU, learned positions, biases)."""
    norm, swiglu = _arg(args, "normalization", default="LayerNorm"), _flag(args, "swiglu")
    pos = _arg(args, "position_embedding_type", default="learned_absolute")
    bias = _flag(args, "add_bias_linear", True)
    if (norm, swiglu, pos, bias) == ("RMSNorm", True, "rope", False):
        if _flag(args, "add_qkv_bias"):
            raise CheckpointError(f"{src}: the checkpoint has biases in the QKV projection only (add_qkv_bias), "
                                  "which megalite's llama does not have")
        return "llama"
    if (norm, swiglu, pos, bias) == ("LayerNorm", False, "learned_absolute", True):
        # Megatron-LM's MLP computes the tanh GeLU when it fuses bias and GeLU (its default) or with openai_gelu;
        # otherwise torch's exact erf GeLU, which megalite's gpt2 MLP (tanh) does not compute.
        if not (_flag(args, "openai_gelu") or _flag(args, "bias_gelu_fusion", True)):
            raise CheckpointError(f"{src}: the checkpoint's MLP is the exact (erf) GeLU (bias_gelu_fusion=False, "
                                  "openai_gelu=False); megalite's gpt2 computes the tanh GeLU: not converted")
        return "gpt2"
    raise CheckpointError(f"{src}: a model with normalization={norm}, swiglu={swiglu}, position embedding {pos}, "
                          f"add_bias_linear={bias}: megalite converts Llama-style (RMSNorm, SwiGLU, rope, no biases) "
                          "and GPT-2-style (LayerNorm, GeLU, learned_absolute, biases) Megatron models")


def count(args: Any, src: Path, name: str, default: Any = None) -> int:
    """A positive integer field of `args` (a crafted or damaged file may hold anything there)."""
    value = getattr(args, name, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{src}: the checkpoint's args.{name} is {value!r}, not a positive integer: the "
                              "model's dims are unknown")
    return value


def iteration(state: dict[str, Any], where: Path) -> int:
    value = state.get("iteration", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: iteration {value!r} is not a step number: the file is damaged or crafted")
    return value


def model_info(args: Any, src: Path, vocab_rows: int, tensor_names: list[str],
               positions: int | None = None) -> dict[str, Any]:
    """megalite's model dims from Megatron's args, refusing architectures megalite lacks.
    `positions`: the rows of a learned position table (a GPT-2-style model's seq_len)."""
    if getattr(args, "num_experts", None):  # megalite has MoE layers (megalite/moe), but not Megatron's names for them
        raise CheckpointError(f"{src}: the checkpoint has mixture-of-experts layers (num_experts={args.num_experts}): "
                              "Megatron's MoE layers are not converted yet (dense models only)")
    for key, what in _UNSUPPORTED:
        value = getattr(args, key, None)
        if value:
            raise CheckpointError(f"{src}: the checkpoint has {what.format(value)}, which megalite does not have")
    vision = next((n for n in tensor_names if "vision" in n), None)
    if vision:
        raise CheckpointError(f"{src}: the checkpoint has a vision tower ({vision}), which megalite does not have")
    for key, what in _UNMODELLED:
        if getattr(args, key, None) not in (None, False, 0, "", ()):  # a string "false" is refused as set, too
            raise CheckpointError(f"{src}: the checkpoint's model has {what}, which megalite does not have")
    arch = _family(args, src)
    layers, heads, hidden, ffn = (count(args, src, n) for n in ("num_layers", "num_attention_heads", "hidden_size",
                                                                 "ffn_hidden_size"))
    kv_channels = count(args, src, "kv_channels", hidden // heads)
    if kv_channels * heads != hidden:
        raise CheckpointError(f"{src}: kv_channels={kv_channels} with {heads} heads of a hidden size {hidden}: "
                              "megalite's head size is hidden_size / num_heads")
    if arch == "llama" and _number(args, "rotary_percent", 1.0) != 1.0:
        raise CheckpointError(f"{src}: rotary_percent={args.rotary_percent}: megalite rotates the whole head")
    groups = count(args, src, "num_query_groups", heads) if _flag(args, "group_query_attention") else heads
    if heads % groups:
        raise CheckpointError(f"{src}: num_query_groups={groups} does not divide num_attention_heads={heads}: the "
                              "checkpoint's args are inconsistent")
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None and count(args, src, "padded_vocab_size") != vocab_rows:
        raise CheckpointError(f"{src}: the checkpoint's args.padded_vocab_size is {padded} but the embedding has "
                              f"{vocab_rows} rows: the args contradict the tensors; the checkpoint is inconsistent")
    seq = count(args, src, "seq_length", _arg(args, "max_position_embeddings", default=2048)) \
        if positions is None else positions
    return {"arch": arch, "num_layers": layers, "hidden_size": hidden,
            "num_heads": heads, "num_kv_heads": groups, "ffn_hidden_size": ffn,
            "vocab_size": vocab_rows, "seq_len": seq,
            "make_vocab_divisible_by": 1, "tie_embeddings": not _flag(args, "untie_embeddings_and_output_weights"),
            "norm_eps": _number(args, "norm_epsilon", 1e-5), "rope_theta": _number(args, "rotary_base", 10000)}


def ungroup_qkv(w: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """Megatron's [g: q heads of group g, k_g, v_g] rows -> megalite's [q; k; v] (a weight or a bias)."""
    nh, ng = info["num_heads"], info["num_kv_heads"]
    hd, rest = info["hidden_size"] // nh, tuple(w.shape[1:])
    g = w.reshape(ng, nh // ng + 2, hd, *rest)
    return torch.cat([g[:, :-2].reshape(nh * hd, *rest), g[:, -2].reshape(ng * hd, *rest),
                      g[:, -1].reshape(ng * hd, *rest)])


_PER_LAYER = {"norm1.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
              "attn.qkv.weight": ("self_attention.linear_qkv.weight",),
              "attn.out.weight": ("self_attention.linear_proj.weight",),
              "norm2.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
              "mlp.up.weight": ("mlp.linear_fc1.weight",),
              "mlp.down.weight": ("mlp.linear_fc2.weight",)}
_GPT2_BIASES = {"norm1.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
                "attn.qkv.bias": ("self_attention.linear_qkv.bias",),
                "attn.out.bias": ("self_attention.linear_proj.bias",),
                "norm2.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
                "mlp.up.bias": ("mlp.linear_fc1.bias",),
                "mlp.down.bias": ("mlp.linear_fc2.bias",)}


def per_layer_names(info: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    return {**_PER_LAYER, **_GPT2_BIASES} if info["arch"] == "gpt2" else _PER_LAYER


def top_level(info: dict[str, Any]) -> dict[str, str]:
    """megalite names -> megatron-core names of the tensors outside the layers."""
    names = {"embedding.weight": "embedding.word_embeddings.weight", "final_norm.weight": "decoder.final_layernorm.weight"}
    if info["arch"] == "gpt2":
        names.update({"position": "embedding.position_embeddings.weight", "final_norm.bias": "decoder.final_layernorm.bias"})
    if not info["tie_embeddings"]:
        names["head.weight"] = "output_layer.weight"
    return names


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


def check_core_names(where: Path, names: list[str]) -> None:
    """The first stage's tensors carry megatron-core's names (else: name what is there instead)."""
    if "embedding.word_embeddings.weight" in names:
        return
    if any(n.startswith("language_model") for n in names):  # megatron.legacy.model's nested state dict
        raise CheckpointError(f"{where}: the model is in the layout of Megatron-LM's pre-core model (language_model.*); "
                              "only megatron-core's names (embedding.*, decoder.layers.*) are read")
    raise CheckpointError(f"{where}: no tensor embedding.word_embeddings.weight (found {sorted(names)[:4]}): not a "
                          "megatron-core GPT checkpoint")


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
        from megalite.checkpoint.interop.megatron_legacy import from_legacy

        return from_legacy(src, weights_only)
    raise CheckpointError(f"{src} is neither a torch_dist checkpoint (metadata.json, .metadata) nor a legacy one "
                          "(mp_rank_XX/model_optim_rng.pt)")
