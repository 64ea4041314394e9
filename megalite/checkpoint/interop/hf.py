"""Hugging Face export and import: `config.json` + `model.safetensors` for LlamaForCausalLM / GPT2LMHeadModel.

Name and layout mapping (megalite's global names on the left; fp32 both ways, tensors streamed one at a time):

  llama  embedding.weight          model.embed_tokens.weight
         layers.i.norm1.weight     model.layers.i.input_layernorm.weight
         layers.i.attn.qkv.weight  model.layers.i.self_attn.{q,k,v}_proj.weight   rows [q; k; v]
         layers.i.attn.out.weight  model.layers.i.self_attn.o_proj.weight
         layers.i.norm2.weight     model.layers.i.post_attention_layernorm.weight
         layers.i.mlp.up.weight    model.layers.i.mlp.{gate,up}_proj.weight       rows [gate; up]
         layers.i.mlp.down.weight  model.layers.i.mlp.down_proj.weight
         final_norm.weight         model.norm.weight
         head.weight               lm_head.weight   (absent when tied: tie_word_embeddings)
  megalite's RoPE is already HF's rotate-half layout, and GQA maps query head h to kv head h // rep as
  HF's `repeat_kv` does, so q/k need no permutation.

  gpt2   embedding.weight / position   transformer.wte.weight / transformer.wpe.weight
         layers.i.norm{1,2}.*          transformer.h.i.ln_{1,2}.*
         layers.i.attn.qkv.*           transformer.h.i.attn.c_attn.*   (c_attn is [q; k; v] too)
         layers.i.attn.out.*           transformer.h.i.attn.c_proj.*
         layers.i.mlp.up.* / down.*    transformer.h.i.mlp.c_fc.* / c_proj.*
         final_norm.*                  transformer.ln_f.*
  GPT-2's Conv1D stores weights as [in, out]: every linear weight is TRANSPOSED (biases are not).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from megalite.checkpoint.files import atomic_output, inside, refuse_link, refuse_output_in_checkpoint
from megalite.checkpoint.interop.hf_files import HF_WEIGHT_DTYPES, hf_tensor_source
from megalite.checkpoint.interop.hf_rope import hf_rope_parameters, rope_scaling_info
from megalite.checkpoint.index_check import model_info_problems
from megalite.checkpoint.offline import Carried, write_checkpoint
from megalite.checkpoint.sharded import find, read_index
from megalite.checkpoint.storage import SlabReader, StreamingWriter
from megalite.errors import CheckpointError, one_line
from megalite.observability.progress import Progress
from megalite.untrusted import loads_json

# (megalite name, HF names, split sizes along megalite dim 0 or None, transposed: HF stores the last two dims swapped,
# as GPT-2's Conv1D [in, out] and gpt-oss's stacked experts [E, in, out]). An HF name may come more than once: its
# pieces are stacked in order along dim 0 (Qwen3-Next's q_proj holds the query and the output gate, which megalite's
# fused qkv keeps apart: [q; k; v; gate] -> q_proj [q; gate], k_proj, v_proj).
Rule = tuple[str, list[str], list[int] | None, bool]


def param_names(info: dict[str, Any]) -> list[str]:
    """Every global parameter name of a megalite GPT with these dims, in model order."""
    gpt2 = info["arch"] == "gpt2"
    per_layer = ["norm1.weight", "attn.qkv.weight", "attn.out.weight", "norm2.weight", "mlp.up.weight",
                 "mlp.down.weight"]
    if gpt2:
        per_layer += ["norm1.bias", "attn.qkv.bias", "attn.out.bias", "norm2.bias", "mlp.up.bias", "mlp.down.bias"]
    names = ["embedding.weight"] + (["position"] if gpt2 else [])
    names += [f"layers.{i}.{n}" for i in range(info["num_layers"]) for n in per_layer]
    names += ["final_norm.weight"] + (["final_norm.bias"] if gpt2 else [])
    return names + ([] if info["tie_embeddings"] else ["head.weight"])


def rules(info: dict[str, Any]) -> list[Rule]:
    """The mapping of every megalite parameter to its HF tensor(s)."""
    hd = info.get("head_dim") or info["hidden_size"] // info["num_heads"]
    qkv = [info["num_heads"] * hd, info["num_kv_heads"] * hd, info["num_kv_heads"] * hd]
    f = info["ffn_hidden_size"]
    out: list[Rule] = []
    for name in param_names(info):
        parts = name.split(".")
        if info["arch"] == "llama":
            if name.startswith("layers."):
                i, rest = parts[1], ".".join(parts[2:])
                p = f"model.layers.{i}."
                rule: Rule = {
                    "norm1.weight": (name, [p + "input_layernorm.weight"], None, False),
                    "attn.qkv.weight": (name, [p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv, False),
                    "attn.out.weight": (name, [p + "self_attn.o_proj.weight"], None, False),
                    "norm2.weight": (name, [p + "post_attention_layernorm.weight"], None, False),
                    "mlp.up.weight": (name, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [f, f], False),
                    "mlp.down.weight": (name, [p + "mlp.down_proj.weight"], None, False)}[rest]
            else:
                rule = (name, [{"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
                                "head.weight": "lm_head.weight"}[name]], None, False)
        else:
            if name.startswith("layers."):
                i, mod, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
                hf_mod = {"norm1": "ln_1", "norm2": "ln_2", "attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj",
                          "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}[mod]
                rule = (name, [f"transformer.h.{i}.{hf_mod}.{kind}"], None, kind == "weight" and "norm" not in mod)
            else:
                rule = (name, [{"embedding.weight": "transformer.wte.weight", "position": "transformer.wpe.weight",
                                "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias",
                                "head.weight": "lm_head.weight"}[name]], None, False)
        out.append(rule)
    return out


def _dims_text(info: dict[str, Any]) -> str:
    return ", ".join(f"{k}={info[k]}" for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                "ffn_hidden_size", "vocab_size"))


def _to_hf(t: torch.Tensor, split: list[int] | None, transposed: bool) -> list[torch.Tensor]:
    pieces = list(t.split(split, dim=0)) if split else [t]
    return [p.transpose(-1, -2).contiguous() if transposed else p.contiguous() for p in pieces]


def stacked(hf_names: list[str], pieces: list[Any]) -> dict[str, list[Any]]:
    """`pieces` grouped by their HF name, in rule order: what makes each HF tensor (a Rule may name one twice)."""
    out: dict[str, list[Any]] = {}
    for name, piece in zip(hf_names, pieces):
        out.setdefault(name, []).append(piece)
    return out


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with its last two dims swapped (a transposed rule's HF shape)."""
    return shape[:-2] + (shape[-1], shape[-2])


def hf_config(info: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers (fp32 weights, no dropout: an inference/fine-tuning starting point)."""
    tie = bool(info["tie_embeddings"])
    if info["arch"] == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": info["hidden_size"],
                "intermediate_size": info["ffn_hidden_size"], "num_attention_heads": info["num_heads"],
                "num_key_value_heads": info["num_kv_heads"], "num_hidden_layers": info["num_layers"],
                "head_dim": info.get("head_dim") or info["hidden_size"] // info["num_heads"], "vocab_size": info["vocab_size"],
                "max_position_embeddings": info["seq_len"], "rms_norm_eps": info["norm_eps"],
                "rope_theta": info["rope_theta"],
                "rope_parameters": {"rope_theta": info["rope_theta"], **hf_rope_parameters(info)},
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "tie_word_embeddings": tie, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if info["num_kv_heads"] != info["num_heads"]:
        raise CheckpointError(f"GPT-2 has no grouped-query attention but this model has num_kv_heads="
                              f"{info['num_kv_heads']} != num_heads={info['num_heads']}: export it as arch=llama")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": info["hidden_size"],
            "n_head": info["num_heads"], "n_layer": info["num_layers"], "n_positions": info["seq_len"],
            "n_inner": info["ffn_hidden_size"], "vocab_size": info["vocab_size"],
            "layer_norm_epsilon": info["norm_eps"], "activation_function": "gelu_new", "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": tie,
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


def info_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """megalite model dims from an HF config.json; refuses what megalite's model cannot compute."""
    kind = cfg.get("model_type")
    if kind == "llama":
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        scaling: dict[str, Any] = {}
        for key in ("rope_parameters", "rope_scaling"):  # the current name and the older one: check both
            given = cfg.get(key)
            if given is not None and not isinstance(given, dict):
                raise CheckpointError(f"this Llama config cannot be imported: {key}={given!r} is not an object")
            scaling = scaling or rope_scaling_info(given or {}, cfg, key)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        bad = [what for what, ok in (
            ("hidden_act must be silu", cfg.get("hidden_act", "silu") == "silu"),
            ("attention_bias/mlp_bias must be false", not cfg.get("attention_bias") and not cfg.get("mlp_bias")),
            ("head_dim must be hidden_size / num_attention_heads", cfg.get("head_dim") in (None, h // nh)),
            ) if not ok]
        if bad:
            raise CheckpointError(f"this Llama config cannot be imported: {'; '.join(bad)}")
        return {"arch": "llama", "num_layers": cfg["num_hidden_layers"], "hidden_size": h, "num_heads": nh,
                "num_kv_heads": cfg.get("num_key_value_heads") or nh, "ffn_hidden_size": cfg["intermediate_size"],
                "vocab_size": cfg["vocab_size"], "seq_len": cfg.get("max_position_embeddings", 2048),
                "make_vocab_divisible_by": 64, "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                "norm_eps": cfg.get("rms_norm_eps", 1e-6), "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 1e4)),
                **scaling}
    if kind == "gpt2":
        if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"GPT-2 activation {cfg['activation_function']!r} is not megalite's tanh GeLU")
        h = cfg["n_embd"]
        return {"arch": "gpt2", "num_layers": cfg["n_layer"], "hidden_size": h, "num_heads": cfg["n_head"],
                "num_kv_heads": cfg["n_head"], "ffn_hidden_size": cfg.get("n_inner") or 4 * h,
                "vocab_size": cfg["vocab_size"], "seq_len": cfg["n_positions"], "make_vocab_divisible_by": 64,
                "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "norm_eps": cfg.get("layer_norm_epsilon", 1e-5), "rope_theta": 10000.0}
    raise CheckpointError(f"HF model_type {kind!r} is not supported: import LlamaForCausalLM or GPT2LMHeadModel")


def expected_shapes(info: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The global shape of every megalite parameter (unpadded vocabulary) implied by the model dims."""
    h, f, v = info["hidden_size"], info["ffn_hidden_size"], info["vocab_size"]
    hd = info.get("head_dim") or h // info["num_heads"]
    q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
    gpt2 = info["arch"] == "gpt2"
    per_layer = {"norm1.weight": (h,), "attn.qkv.weight": (q + 2 * kv, h), "attn.out.weight": (h, q),
                 "norm2.weight": (h,), "mlp.up.weight": ((1 if gpt2 else 2) * f, h), "mlp.down.weight": (h, f),
                 "norm1.bias": (h,), "attn.qkv.bias": (q + 2 * kv,), "attn.out.bias": (h,), "norm2.bias": (h,),
                 "mlp.up.bias": (f,), "mlp.down.bias": (h,)}
    top = {"embedding.weight": (v, h), "position": (info.get("seq_len", 0), h), "final_norm.weight": (h,),
           "final_norm.bias": (h,), "head.weight": (v, h)}
    return {n: per_layer[n.split(".", 2)[2]] if n.startswith("layers.") else top[n] for n in param_names(info)}


def _checked_info(info: dict[str, Any], source: str) -> None:
    """Every dim is a bounded integer, eps/theta positive finite numbers (`model_info_problems`): an HF
    `max_position_embeddings` of -5 or "32" is refused, not imported as is."""
    problems = model_info_problems(info)
    problems += [f"{k} is missing" for k in ("seq_len", "norm_eps", "rope_theta") if k not in info]
    if problems:
        raise CheckpointError(f"{source}: model dims unusable ({'; '.join(problems)})")


@dataclass(frozen=True)
class HFMapping:
    """What differs between architectures: config.json <-> model info, and the tensor names and shapes.
    `DENSE` is this module's (Llama, GPT-2); `megalite.checkpoint.interop.hf_moe.MAPPING` adds Mixtral and Qwen3(-MoE)."""

    info_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    hf_config: Callable[[dict[str, Any]], dict[str, Any]]
    rules: Callable[[dict[str, Any]], list[Rule]]
    expected_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    # Wraps the import's reader of HF tensors (name -> tensor, name -> shape), given the info and config.json: e.g.
    # stacks per-expert tensors into the fused names `rules` give, dequantises FP8; None reads them as they are.
    source: Callable[[TensorSource, dict[str, Any], dict[str, Any]], TensorSource] | None = None
    # The export's last step on each HF tensor (HF name, tensor, model info), e.g. a row permutation; None: as is.
    export_tensor: Callable[[str, torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
    # The shape `export_tensor` gives an HF tensor of megalite's layout and `shape` (HF name, shape, model info) where
    # it reshapes (Qwen3.5's conv1d.weight [C, 1, W] of megalite's [C, W]); None: it keeps every shape.
    export_shape: Callable[[str, tuple[int, ...], dict[str, Any]], tuple[int, ...]] | None = None


def tensor_key(name: str) -> str:
    """A rule's name as a checkpoint key: "param/<name>", or a buffer's "buffer/<name>" as the rule gives it."""
    return name if name.startswith("buffer/") else f"param/{name}"


TensorSource = tuple[Callable[[str], torch.Tensor], Callable[[str], list[int]]]
DENSE = HFMapping(info_from_hf, hf_config, rules, expected_shapes)
EXPORT_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}


def export_hf(ckpt: str | Path, out: str | Path, show_progress: bool = True, tokenizer: str = "",
              dtype: str = "fp32", mapping: HFMapping = DENSE, chat_template: str = "") -> Path:
    """Write `out/config.json` and `out/model.safetensors` from a megalite checkpoint (any layout); with
    `tokenizer`, also its tokenizer files (see megalite/checkpoint/interop/hf_tokenizer.py) and its BOS/EOS ids in
    config.json. `dtype` "bf16" stores the weights in bfloat16 (half the size; fp32 is exact). The chat template
    (`chat_template`, a file; else the SFT run's, from the checkpoint's config) goes into tokenizer_config.json.

    The weights and config are written under temporary names and renamed into place only when complete: a
    failing export leaves an existing export in `out` exactly as it was."""
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype, dtype_name = EXPORT_DTYPES[dtype]
    src = find(str(ckpt), "")
    if src is None:
        raise CheckpointError(f"--input {ckpt}: give a checkpoint directory")
    refuse_output_in_checkpoint(out)
    index = read_index(src)
    info = index["model"]
    _checked_info(info, str(src / "index.json"))
    config = mapping.hf_config(info)
    config["torch_dtype"] = dtype_name
    tok = None
    if tokenizer:
        from megalite.checkpoint.interop.hf_tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        if tok.vocab_size > info["vocab_size"]:
            raise CheckpointError(f"--tokenizer {tokenizer} has {tok.vocab_size} ids, more than the model's "
                                  f"vocab_size {info['vocab_size']}: pass the tokenizer the model was trained with")
        config["eos_token_id"] = tok.eod_id
        config["bos_token_id"] = tok.bos_id if tok.add_bos else None
    reader = SlabReader(src, index)
    table = mapping.rules(info)
    want = mapping.expected_shapes(info)
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, hf_names, split, transposed in table:
        if not reader.has(tensor_key(name)):
            raise CheckpointError(f"checkpoint {src} has no tensor {name}: it does not match its own model dims")
        shape = reader.shape(tensor_key(name))
        if shape != want[name]:
            raise CheckpointError(f"checkpoint {src}: {name} has shape {list(shape)} but its model dims imply "
                                  f"{list(want[name])}: index.json is inconsistent")
        for hf_name, rows in stacked(hf_names, list(split or [shape[0]])).items():
            s = (sum(rows),) + shape[1:]
            s = _swapped(s) if transposed else s
            plan.append((hf_name, torch_dtype, mapping.export_shape(hf_name, s, info) if mapping.export_shape else s))
    out = Path(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise CheckpointError(f"--output {out} is a file or lies under one: give a directory") from e
    # Tokenizer files are built (and checked) in a staging folder first, moved in only after the weights.
    staged = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out)) if tok is not None else None
    try:
        if tok is not None and staged is not None:
            from megalite.checkpoint.interop.hf_tokenizer import export_tokenizer

            export_tokenizer(tok, staged, _chat_template(index, tokenizer, chat_template))
            for f in staged.iterdir():
                refuse_link(out / f.name, hard_links=False)  # before the weights: all or nothing
        with atomic_output(out / "model.safetensors") as tmp_model, atomic_output(out / "config.json") as tmp_cfg:
            writer = StreamingWriter(tmp_model, plan)
            try:
                with Progress(len(table), "exporting", "tensors", enabled=show_progress) as bar:
                    for name, hf_names, split, transposed in table:
                        shape = reader.shape(tensor_key(name))
                        full = reader.read_region(tensor_key(name), (0,) * len(shape), shape)
                        pieces = stacked(hf_names, _to_hf(full, split, transposed))
                        for hf_name, t in ((n, torch.cat(p, dim=0)) for n, p in pieces.items()):
                            if mapping.export_tensor is not None:
                                t = mapping.export_tensor(hf_name, t, info)
                            writer.write(hf_name, t.to(torch_dtype))
                        bar.update()
            except BaseException:
                writer.abort()
                raise
            writer.close()
            tmp_cfg.write_text(json.dumps(config, indent=2))
        for f in sorted(staged.iterdir()) if staged is not None else []:
            os.replace(f, out / f.name)  # same directory: each rename is atomic
    except BaseException:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the directory this call made, still empty
        raise
    finally:
        reader.close()
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    return out


def not_exported(ckpt: str | Path, mapping: HFMapping = DENSE) -> list[str]:
    """What `export_hf` leaves behind of checkpoint `ckpt`, one phrase per module: the stored tensors no rule of the
    target architecture reads (a multi-token prediction module of a model without MLA: only DeepseekV3's layout has
    a place for MTP). The tools name them rather than drop them without a word."""
    src = find(str(ckpt), "")
    if src is None:
        return []
    index = read_index(src)
    exported = {tensor_key(name) for name, *_ in mapping.rules(index["model"])}
    modules: dict[str, int] = {}
    for key in index["tensors"]:
        kind, _, name = key.partition("/")
        if kind in ("param", "buffer") and key not in exported:
            parts = name.split(".")
            module = ".".join(parts[:3]) if parts[:2] == ["mtp", "layers"] else name
            modules[module] = modules.get(module, 0) + 1
    return [f"{m} ({n} tensor{'s' if n > 1 else ''})" for m, n in sorted(modules.items())]


def _chat_template(index: dict[str, Any], tokenizer: str, template_file: str) -> str | None:
    """The chat template an export carries: `template_file`, else the one an SFT run (data.format = chat) used."""
    from megalite.data.chat_template import load_template_text

    config = index.get("extra", {}).get("config", {}) if isinstance(index.get("extra"), dict) else {}
    data = config.get("data", {}) if isinstance(config, dict) else {}
    if template_file:
        return load_template_text(tokenizer, template_file)
    if isinstance(data, dict) and data.get("format") == "chat":
        return load_template_text(tokenizer, str(data.get("chat_template", "")))
    return None


def import_hf(hf_dir: str | Path, out: str | Path, show_progress: bool = True, mapping: HFMapping = DENSE) -> Path:
    """A megalite checkpoint (step 0, no optimizer state, one file of full tensors) from an HF directory."""
    hf_dir = Path(hf_dir)
    try:
        cfg = loads_json((hf_dir / "config.json").read_text(encoding="utf-8"), str(hf_dir / "config.json"),
                         CheckpointError)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {hf_dir / 'config.json'} ({e}): point --input at an HF model directory") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{hf_dir / 'config.json'} is not a JSON object")
    try:
        info = mapping.info_from_hf(cfg)
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{hf_dir / 'config.json'} lacks or garbles a model dimension ({e!r}): it is not a "
                              f"complete {cfg.get('model_type')} config") from e
    _checked_info(info, str(hf_dir / "config.json"))
    get, shape_of = hf_tensor_source(hf_dir)
    if mapping.source is not None:
        get, shape_of = mapping.source((get, shape_of), info, cfg)
    table: dict[str, tuple[list[str], list[int] | None, bool]] = {}  # a name's first rule; later ones: export copies
    for name, hf_names, split, transposed in mapping.rules(info):
        table.setdefault(name, (hf_names, split, transposed))
    want = mapping.expected_shapes(info)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (named, _, transposed) in table.items():
        hf_names = list(dict.fromkeys(named))  # an HF tensor stacking several pieces: read (and sized) once
        parts = [tuple(shape_of(n)) for n in hf_names]
        if any(len(s) != len(want[name]) for s in parts):
            raise CheckpointError(f"{hf_dir}: {hf_names[0]} has shape {list(parts[0])}, not a {len(want[name])}-D tensor")
        ours = [_swapped(s) if transposed else s for s in parts]  # each part in megalite's layout
        key = tensor_key(name)
        shapes[key] = (sum(s[0] for s in ours),) + ours[0][1:]
        if shapes[key] != want[name]:
            raise CheckpointError(f"{hf_dir}: the tensors of {name} ({', '.join(hf_names)}) have shapes {parts}, which "
                                  f"disagree with config.json ({_dims_text(info)}): the config does not describe these "
                                  "weights")

    def fetch(key: str) -> torch.Tensor:
        hf_names, split, transposed = table[key.removeprefix("param/")]
        whole = {n: get(n) for n in dict.fromkeys(hf_names)}
        if any(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in whole.values()):
            raise CheckpointError(f"{hf_dir}: {hf_names[0]} is {whole[hf_names[0]].dtype} and this architecture's "
                                  "import does not dequantise it: convert the model to bf16/fp32 first")
        ours = {n: p.transpose(-1, -2) if transposed else p for n, p in whole.items()}
        taken, pieces = dict.fromkeys(ours, 0), []  # a name given twice: cut by the rule's split sizes, in order
        for n, rows in zip(hf_names, split or [ours[n].shape[0] for n in hf_names]):
            pieces.append(ours[n][taken[n]:taken[n] + rows])
            taken[n] += rows
        return torch.cat(pieces, dim=0)

    extra = {"imported_from": str(hf_dir), "model": info}
    return write_checkpoint(Path(out), shapes, fetch, info, carried=Carried(extra, step=0), show_progress=show_progress)
