"""Megatron-LM's model in megalite's terms: its `args` read into megalite's model dims (refusing what megalite's
layers lack, every field's type checked), its tensor names mapped to megalite's, its query-group-interleaved QKV
regrouped, and the allow-listed unpickler its files are read with. Shared by the torch_dist reader
(`megalite.checkpoint.interop.megatron`) and the legacy one (`megatron_legacy`); the module doc of the former
describes both layouts and the mapping.
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

from megalite.errors import CheckpointError

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


def check_core_names(where: Path, names: list[str]) -> None:
    """The first stage's tensors carry megatron-core's names (else: name what is there instead)."""
    if "embedding.word_embeddings.weight" in names:
        return
    if any(n.startswith("language_model") for n in names):  # megatron.legacy.model's nested state dict
        raise CheckpointError(f"{where}: the model is in the layout of Megatron-LM's pre-core model (language_model.*); "
                              "only megatron-core's names (embedding.*, decoder.layers.*) are read")
    raise CheckpointError(f"{where}: no tensor embedding.word_embeddings.weight (found {sorted(names)[:4]}): not a "
                          "megatron-core GPT checkpoint")
