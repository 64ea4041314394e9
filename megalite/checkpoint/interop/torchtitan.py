"""torchtitan's Llama 3 DCP checkpoints, both ways (torchtitan 0.3's names and layout).

What torchtitan's CheckpointManager writes for `checkpoint/step-N` is one DCP directory whose state dict has the
model's keys at the top level (its `ModelWrapper.state_dict()`, flattened in) and the optimizer's state under
"optimizer", flat and keyed by parameter name (`get_flat_optim_state_dict`: "state.<fqn>.exp_avg",
"state.<fqn>.step", "param_groups.<fqn>.lr", ...). The mapping (megalite's name on the left):

    embedding.weight           tok_embeddings.weight
    layers.i.norm1.weight      layers.i.attention_norm.weight
    layers.i.attn.qkv.weight   layers.i.attention.qkv_linear.{wq,wk,wv}.weight   rows [q; k; v], q and k
                               permuted per head (see below); a fused `wqkv` (kv-group-major rows:
                               per kv head its queries, then k, then v) is read too
    layers.i.attn.out.weight   layers.i.attention.wo.weight
    layers.i.norm2.weight      layers.i.ffn_norm.weight
    layers.i.mlp.up.weight     layers.i.feed_forward.{w1,w3}.weight               rows [gate (w1); up (w3)]
    layers.i.mlp.down.weight   layers.i.feed_forward.w2.weight
    final_norm.weight          norm.weight
    head.weight                lm_head.weight   (tied: the embedding)

RoPE: torchtitan rotates interleaved pairs (x[2j], x[2j+1]) as complex numbers (Meta's layout); megalite rotates
halves (x[j], x[j + hd/2]), as Hugging Face does. The same rotation in the other layout is a fixed permutation
of each head's rows of wq and wk (the one Hugging Face's Llama converter applies), so logits agree and the
conversion is exact both ways; Adam moments are elementwise and get the same permutation.

torchtitan does not store the model's config in a checkpoint, so heads, norm eps and RoPE theta come from a
small JSON file (`megalite_model_args.json`, written next to every torchtitan output and read from the input
directory, or given with --model-args); the other dims are read from the tensor shapes, and a file that
contradicts them is refused. The lr scheduler, data loader and train-step states are not converted (load the
output in torchtitan with `checkpoint.exclude_from_loading = ["lr_scheduler", "dataloader", "train_state"]`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from megalite.checkpoint.interop.dcp import load_tensor, read_metadata, save_dcp, tensor_shapes
from megalite.checkpoint.index_check import MAX_COUNT, MAX_DIM
from megalite.checkpoint.interop.source import Source, optimizer_kind, refuse_moments_without_adam
from megalite.config.aliases import saved_config
from megalite.errors import CheckpointError
from megalite.untrusted import load_json_file

ARGS_FILE = "megalite_model_args.json"
_STATES = ("exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def meta_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one projection from torchtitan's interleaved-pair RoPE order to rotate-half order, per head."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def hf_to_meta(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _titan_tensors(info: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(megalite name, its torchtitan names) for every parameter."""
    out = [("embedding.weight", ["tok_embeddings.weight"])]
    for i in range(info["num_layers"]):
        p = f"layers.{i}."
        out += [(p + "norm1.weight", [p + "attention_norm.weight"]),
                (p + "attn.qkv.weight", [p + f"attention.qkv_linear.w{x}.weight" for x in "qkv"]),
                (p + "attn.out.weight", [p + "attention.wo.weight"]),
                (p + "norm2.weight", [p + "ffn_norm.weight"]),
                (p + "mlp.up.weight", [p + "feed_forward.w1.weight", p + "feed_forward.w3.weight"]),
                (p + "mlp.down.weight", [p + "feed_forward.w2.weight"])]
    out.append(("final_norm.weight", ["norm.weight"]))
    if not info["tie_embeddings"]:
        out.append(("head.weight", ["lm_head.weight"]))
    return out


def _to_titan(name: str, t: torch.Tensor, info: dict[str, Any]) -> list[torch.Tensor]:
    """megalite tensor -> its torchtitan piece(s), in `_titan_tensors` order."""
    if name.endswith("attn.qkv.weight"):
        hd = info["hidden_size"] // info["num_heads"]
        q, k, v = t.split([info["num_heads"] * hd, info["num_kv_heads"] * hd, info["num_kv_heads"] * hd])
        return [hf_to_meta(q, info["num_heads"]), hf_to_meta(k, info["num_kv_heads"]), v.contiguous()]
    if name.endswith("mlp.up.weight"):
        return [x.contiguous() for x in t.chunk(2)]
    return [t]


def _check_titan_model(info: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """torchtitan's Llama 3 must hold every tensor of the model, and nothing may be left out silently: a MoE
    model's experts and router, Qwen3's q/k norms or a head size other than dim / n_heads have no place in it."""
    if info.get("arch") != "llama":
        raise CheckpointError(f"torchtitan's Llama holds arch 'llama' models; this checkpoint is {info.get('arch')!r}")
    head_dim = info.get("head_dim") or info["hidden_size"] // info["num_heads"]
    if head_dim * info["num_heads"] != info["hidden_size"]:
        raise CheckpointError(f"the model's head_dim {head_dim} x {info['num_heads']} heads is not its hidden size "
                              f"{info['hidden_size']}: torchtitan's Llama 3 has head size dim / n_heads")
    mapped = {f"param/{name}" for name, _ in _titan_tensors(info)}
    unmapped = sorted(k for k in shapes if not k.startswith(_STATES) and k not in mapped)
    missing = sorted(mapped - set(shapes))
    if unmapped or missing:
        what = f"has {unmapped[0]}, which torchtitan's Llama 3 has no place for" if unmapped else \
            f"lacks {missing[0]}, which torchtitan's Llama 3 needs"
        raise CheckpointError(f"the checkpoint {what} (MoE layers and q/k norms do not convert to torchtitan's "
                              "dense Llama 3; --to dcp keeps every tensor)")


def _fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """torchtitan's fused wqkv rows: per kv head g, its queries, then k_g, then v_g."""
    groups = [t.reshape(kv_heads, -1, t.shape[-1]) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, q.shape[-1]).contiguous()


def to_torchtitan(source: Source, out: Path, fused_qkv: bool = False) -> Path:
    """Write `source` (a Llama) as torchtitan's DCP checkpoint of model + optimizer (memory: the whole model).
    `fused_qkv`: for a torchtitan model built with fuse_qkv=True, whose optimizer holds the fused `wqkv`
    (its model state dict shows wq/wk/wv either way)."""
    info = source.info
    try:
        _check_titan_model(info, source.shapes)
        if source.has_optimizer_state() and optimizer_kind(source.extra) == "muon":
            raise CheckpointError("the checkpoint's optimizer state is Muon's (its momentum, no second moment), which "
                                  "torchtitan's AdamW cannot hold: convert with --weights-only (the optimizer then "
                                  "starts fresh), or --to dcp, which keeps it")
        full = {k: source.fetch(k) for k in source.shapes}
    finally:
        source.close()
    refuse_moments_without_adam(full, "torchtitan's AdamW")
    sd: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    config = saved_config(source.extra)
    train, opt = config.get("train", {}), config.get("optimizer", {})
    group = {"lr": float(train.get("lr", 0.0)), "betas": (float(opt.get("beta1", 0.9)), float(opt.get("beta2", 0.95))),
             "eps": float(opt.get("adam_eps", 1e-8)), "weight_decay": float(opt.get("weight_decay", 0.0)),
             "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "decoupled_weight_decay": True}
    for name, titan in _titan_tensors(info):
        for kind in ("param",) + _STATES:
            key = f"{kind}/{name}"
            if key not in full:
                continue
            pieces = _to_titan(name, full[key], info)
            for tname, piece in zip(titan, pieces):
                if kind == "param":
                    sd[tname] = piece
                elif not (fused_qkv and name.endswith("attn.qkv.weight")):
                    optim[f"state.{tname}.{kind}"] = piece
            if kind != "param" and fused_qkv and name.endswith("attn.qkv.weight"):
                optim[f"state.{_fused_name(titan[0])}.{kind}"] = _fuse(pieces[0], pieces[1], pieces[2],
                                                                       info["num_kv_heads"])
        for tname in ([_fused_name(titan[0])] if fused_qkv and name.endswith("attn.qkv.weight") else titan):
            if f"exp_avg/{name}" in full:
                optim[f"state.{tname}.step"] = torch.tensor(float(source.optimizer_step or 0.0))
            optim.update({f"param_groups.{tname}.{k}": v for k, v in group.items()})
    if info["tie_embeddings"]:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
    sd["optimizer"] = optim
    args = {"dim": info["hidden_size"], "n_layers": info["num_layers"], "n_heads": info["num_heads"],
            "n_kv_heads": info["num_kv_heads"], "vocab_size": info["vocab_size"], "hidden_dim": info["ffn_hidden_size"],
            "norm_eps": info["norm_eps"], "rope_theta": info["rope_theta"], "max_seq_len": info["seq_len"],
            "enable_weight_tying": bool(info["tie_embeddings"]), "rope_scaling": "none", "step": source.step}
    return save_dcp(out, sd, {ARGS_FILE: json.dumps(args, indent=1) + "\n"})  # beside the DCP files: torchtitan ignores it


def _fused_name(wq_name: str) -> str:
    return wq_name.replace(".wq.", ".wqkv.")


def _model_args(src: Path, given: Path | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    path = given or src / ARGS_FILE
    if not path.is_file():
        raise CheckpointError(f"{src}: torchtitan checkpoints do not record the model's heads, norm eps and RoPE "
                              f"theta; give them with --model-args FILE.json ({path} not found)")
    args = load_json_file(path, f"the model args {path}", CheckpointError)
    if not isinstance(args, dict):
        raise CheckpointError(f"the model args {path} are not a JSON object of torchtitan's model args")
    limits = {"n_heads": MAX_DIM["num_heads"], "n_kv_heads": MAX_DIM["num_kv_heads"], "max_seq_len": MAX_DIM["seq_len"],
              "dim": MAX_DIM["hidden_size"], "n_layers": MAX_DIM["num_layers"], "vocab_size": MAX_DIM["vocab_size"],
              "hidden_dim": MAX_DIM["ffn_hidden_size"], "step": MAX_COUNT}
    for key, most in limits.items():
        value, least = args.get(key), 0 if key == "step" else 1
        if (key == "n_heads" or value is not None) and (isinstance(value, bool) or not isinstance(value, int)
                                                         or not least <= value <= most):
            what = "an integer" if key == "step" else "a positive integer"
            raise CheckpointError(f"the model args {path}: {key} is {value!r}, not {what} (at most {most})")
    for key in ("norm_eps", "rope_theta"):
        if key in args and (isinstance(args[key], bool) or not isinstance(args[key], (int, float))
                            or not 0 < args[key] < float("inf")):
            raise CheckpointError(f"the model args {path}: {key} is {args[key]!r}, not a positive number")
    if not isinstance(args.get("enable_weight_tying", False), bool):
        raise CheckpointError(f"the model args {path}: enable_weight_tying is {args['enable_weight_tying']!r}, not "
                              "true or false (a JSON boolean)")
    scaling = args.get("rope_scaling", "none")
    if scaling not in ("none", None):
        raise CheckpointError(f"{path}: rope_scaling {scaling!r} (Llama 3.1 frequency scaling) is not in megalite's "
                              "model: only unscaled RoPE converts exactly")
    if "layers.0.attention.qkv_linear.wqkv.weight" not in shapes and "layers.0.attention.qkv_linear.wq.weight" not in shapes:
        found = sorted({k.split(".")[3] for k in shapes if k.startswith("layers.0.") and k.count(".") > 3})
        raise CheckpointError(f"{src}: layer 0 has no grouped-query attention projections (found {found}): not a "
                              "torchtitan Llama 3 checkpoint (MoE, MLA and vision models are not supported)")
    return args


def _expected(info: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """torchtitan name -> (the shape the model args make it, which args those are), for every model tensor."""
    dim, nh, nkv, hid, vocab = (info[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                                                   "vocab_size"))
    hd = dim // nh
    out = {"tok_embeddings.weight": ((vocab, dim), f"vocab_size={vocab}, dim={dim}"),
           "norm.weight": ((dim,), f"dim={dim}"), "lm_head.weight": ((vocab, dim), f"vocab_size={vocab}, dim={dim}")}
    for i in range(info["num_layers"]):
        p, a = f"layers.{i}.", f"layers.{i}.attention.qkv_linear."
        out.update({p + "attention_norm.weight": ((dim,), f"dim={dim}"), p + "ffn_norm.weight": ((dim,), f"dim={dim}"),
                    a + "wq.weight": ((nh * hd, dim), f"n_heads={nh}"),
                    a + "wk.weight": ((nkv * hd, dim), f"n_kv_heads={nkv}"),
                    a + "wv.weight": ((nkv * hd, dim), f"n_kv_heads={nkv}"),
                    a + "wqkv.weight": (((nh + 2 * nkv) * hd, dim), f"n_heads={nh}, n_kv_heads={nkv}"),
                    p + "attention.wo.weight": ((dim, nh * hd), f"n_heads={nh}"),
                    p + "feed_forward.w1.weight": ((hid, dim), f"hidden_dim={hid} (layer 0's)"),
                    p + "feed_forward.w3.weight": ((hid, dim), f"hidden_dim={hid} (layer 0's)"),
                    p + "feed_forward.w2.weight": ((dim, hid), f"hidden_dim={hid} (layer 0's)")})
    return out


def _check_shapes(src: Path, flat: dict[str, tuple[int, ...]], info: dict[str, Any]) -> None:
    """Every model tensor and Adam moment has the shape the model args give it: an n_kv_heads that contradicts
    the k/v rows, or a layer wider than layer 0, is refused before anything is read (else rows are cut or
    regrouped without a word)."""
    want = _expected(info)
    for key, have in flat.items():
        name = key[len("optimizer.state."):].rpartition(".")[0] if key.startswith("optimizer.state.") else key
        if name in want and tuple(have) != want[name][0] and not key.endswith(".step"):
            shape, why = want[name]
            raise CheckpointError(f"{src}: {key} is {list(have)} but the model args ({why}) make it {list(shape)}: "
                                  "the args contradict the tensors (or the layers differ in width); give this "
                                  "checkpoint's model args")


def _check_tying(src: Path, flat: dict[str, tuple[int, ...]], tied: bool) -> None:
    """enable_weight_tying must say what the tensors hold: a tied model's lm_head (torchtitan saves it too) is
    the embedding; converting an untied one as tied would drop its head."""
    if not tied or "lm_head.weight" not in flat or flat["lm_head.weight"] != flat["tok_embeddings.weight"]:
        return
    head = load_tensor(src, ["lm_head.weight"], flat["lm_head.weight"])
    emb = load_tensor(src, ["tok_embeddings.weight"], flat["tok_embeddings.weight"])
    if not torch.equal(head, emb):
        raise CheckpointError(f"{src}: the model args say enable_weight_tying=true but lm_head.weight differs from "
                              f"tok_embeddings.weight (by up to {float((head - emb).abs().max()):.3g}): set "
                              "enable_weight_tying to false in the model args")


def _optimizer_entries(src: Path, md: Any, flat: dict[str, tuple[int, ...]], weights_only: bool) -> list[str]:
    """Refuse optimizer state other than AdamW's (it would be dropped); what is not carried, one phrase each."""
    if weights_only:
        return ["the optimizer state (--weights-only)"] if any(k.startswith("optimizer.") for k in flat) else []
    odd = sorted(k for k in flat if k.startswith("optimizer.")
                 and not (k.startswith("optimizer.state.") and k.rpartition(".")[2] in _STATES + ("step",)))
    if odd:
        raise CheckpointError(f"{src}: optimizer entry {odd[0]} is not AdamW's (exp_avg, exp_avg_sq, step): megalite "
                              "cannot hold that optimizer's state; convert with --weights-only (it then starts fresh)")
    top = sorted({k.split(".", 1)[0] for k in md.state_dict_metadata if k.split(".", 1)[0] != "optimizer"
                  and k not in flat and k != "lm_head.weight"})
    dropped = [f"torchtitan's {', '.join(top)} state"] if top else []
    if any(k.startswith("optimizer.param_groups.") for k in md.state_dict_metadata):
        dropped.append("the optimizer's hyper-parameters (param_groups: the megalite run's config sets them)")
    return dropped


def from_torchtitan(src: Path, model_args: Path | None = None, weights_only: bool = False) -> Source:
    """torchtitan's Llama 3 DCP checkpoint directory (`checkpoint/step-N`) as megalite tensors."""
    md = read_metadata(src)
    flat = tensor_shapes(md)
    args = _model_args(src, model_args, flat)
    moe = sorted(k for k in flat if ".moe." in k or ".experts." in k)[:1]
    if moe:
        raise CheckpointError(f"{src}: {moe[0]} is a mixture-of-experts tensor: torchtitan's MoE models "
                              "are not converted yet (dense Llama 3 only)")
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w1.weight"):
        if len(flat.get(key, ())) != 2:
            raise CheckpointError(f"{src}: no 2-d tensor {key} in the checkpoint: not a torchtitan Llama 3 checkpoint")
    dropped = _optimizer_entries(src, md, flat, weights_only)
    if weights_only:
        flat = {k: v for k, v in flat.items() if not k.startswith("optimizer.")}
    dim, vocab = flat["tok_embeddings.weight"][1], flat["tok_embeddings.weight"][0]
    layers = 1 + max(int(m.group(1)) for k in flat if (m := _LAYER.match(k)))
    hidden = flat["layers.0.feed_forward.w1.weight"][0]
    info: dict[str, Any] = {"arch": "llama", "num_layers": layers, "hidden_size": dim, "num_heads": args["n_heads"],
            "num_kv_heads": args.get("n_kv_heads") or args["n_heads"], "ffn_hidden_size": hidden,
            "vocab_size": vocab, "seq_len": args.get("max_seq_len", 2048), "make_vocab_divisible_by": 1,
            "tie_embeddings": args.get("enable_weight_tying", False), "norm_eps": float(args.get("norm_eps", 1e-5)),
            "rope_theta": float(args.get("rope_theta", 10000.0))}
    for key, have in (("dim", dim), ("n_layers", layers), ("vocab_size", vocab), ("hidden_dim", hidden)):
        if key in args and args[key] != have:
            raise CheckpointError(f"{src}: the model args say {key}={args[key]} but the tensors have {have}: "
                                  "give the args of this checkpoint's model")
    known = {n for _, names in _titan_tensors(info) for n in names} | {"lm_head.weight"}  # also saved when tied
    known |= {_fused_name(n) for n in known if ".wq." in n}
    stray = sorted(k for k in flat if not k.startswith("optimizer.") and k not in known)
    if stray:  # e.g. a Qwen3-style q_norm: dropping it would change the logits without a word
        raise CheckpointError(f"{src}: tensor {stray[0]} has no place in megalite's llama (torchtitan's dense "
                              "Llama 3 is converted: q/k norms, biases and other extras are not)")
    nh, nkv = int(info["num_heads"]), int(info["num_kv_heads"])
    if dim % nh or nh % nkv or (dim // nh) % 2:
        raise CheckpointError(f"{src}: n_heads={nh}, n_kv_heads={nkv} do not fit dim={dim} (n_heads must divide dim "
                              "into an even head size, n_kv_heads must divide n_heads): give this model's args")
    _check_shapes(src, flat, info)
    _check_tying(src, flat, info["tie_embeddings"])
    hd = dim // nh
    step_key = next((k for k in flat if k.startswith("optimizer.state.") and k.endswith(".step")), None)

    def titan(prefix: str, tname: str) -> torch.Tensor:
        key = f"{prefix}{tname}" if not prefix else f"optimizer.state.{tname}.{prefix}"
        if key not in flat:
            raise CheckpointError(f"{src}: tensor {key} is missing from the checkpoint")
        path = [key] if not prefix else ["optimizer", f"state.{tname}.{prefix}"]
        return load_tensor(src, path, flat[key])

    def fetch(key: str) -> torch.Tensor:
        kind, name = key.split("/", 1)
        prefix = "" if kind == "param" else kind
        names = dict(_titan_tensors(info))[name]
        if name.endswith("attn.qkv.weight"):
            wqkv = _fused_name(names[0])
            if (f"optimizer.state.{wqkv}.{prefix}" if prefix else wqkv) in flat:  # fused: kv-group-major rows
                w = titan(prefix, wqkv)
                g = w.reshape(nkv, nh // nkv + 2, hd, dim)
                q, k, v = g[:, :-2].reshape(nh * hd, dim), g[:, -2].reshape(nkv * hd, dim), g[:, -1].reshape(nkv * hd, dim)
            else:
                q, k, v = (titan(prefix, n) for n in names)
            return torch.cat([meta_to_hf(q, nh), meta_to_hf(k, nkv), v])
        return torch.cat([titan(prefix, n) for n in names]) if len(names) > 1 else titan(prefix, names[0])

    shapes: dict[str, tuple[int, ...]] = {}
    for name, titan_names in _titan_tensors(info):
        first = titan_names[0]
        if first not in flat and _fused_name(first) in flat:
            first = _fused_name(first)
        if first not in flat:
            raise CheckpointError(f"{src}: tensor {first} is missing from the checkpoint")
        full = {"attn.qkv.weight": ((nh + 2 * nkv) * hd, dim), "mlp.up.weight": (2 * hidden, dim)}.get(
            name.split(".", 2)[-1], flat[first])
        shapes[f"param/{name}"] = tuple(full)
        if {f"optimizer.state.{n}.exp_avg" for n in (first, _fused_name(first))} & set(flat):
            shapes[f"exp_avg/{name}"] = shapes[f"exp_avg_sq/{name}"] = tuple(full)
    opt_step = float(load_tensor(src, ["optimizer", step_key[len("optimizer."):]], ())) if step_key else None
    if opt_step is not None and not 0 <= opt_step <= MAX_COUNT:  # NaN fails both comparisons
        raise CheckpointError(f"{src}: the optimizer's {step_key} is {opt_step}, not a step count: the checkpoint is "
                              "damaged or edited")
    fetch_fn: Callable[[str], torch.Tensor] = fetch
    return Source(info, shapes, fetch_fn, args.get("step", 0), opt_step, {}, dropped=dropped)

