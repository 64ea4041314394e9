"""Megatron-LM's legacy checkpoints in: `iter_N/mp_rank_<tp>[_<pp>]/model_optim_rng.pt`, one torch.save per
(tp, pp) rank ({"args", "iteration", "model": that rank's shards, layers numbered from 0 on every stage}), merged
over TP and PP into megalite's logical tensors (the names and the QKV regrouping: `megatron_model`).

Every file is read with the allow-listed unpickler (`megatron_model.safe_load`); every merged tensor is checked against
the shape the args give it (`megatron_checks`), a tied head's saved copy against the embedding; a model tensor
the conversion does not place is refused, and optimizer state unless --weights-only. The RNG and scheduler
states are named as not carried.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megalite.checkpoint.interop.megatron_model import (LAYER, RANK_DIR, check_core_names, count, iteration,
                                                        model_info, per_layer_names, safe_load, top_level,
                                                        ungroup_qkv)
from megalite.checkpoint.interop.megatron_checks import (check_shape, check_tied_head, has_tensors, layer_shapes,
                                                         leftover_tensors, refuse_optimizer_state, top_shapes)
from megalite.checkpoint.interop.source import Source
from megalite.errors import CheckpointError


def _merge_tp(rest: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    if rest.startswith(("norm1.", "norm2.")) or rest in ("attn.out.bias", "mlp.down.bias"):
        return shards[0]  # replicated: norms, and the row-parallel linears' biases (added after the all-reduce)
    if rest in ("attn.out.weight", "mlp.down.weight"):
        return torch.cat(shards, dim=1)
    if rest == "mlp.up.weight" and gated:  # every shard is [gate_r; up_r]
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards)  # qkv (whole query groups per rank), fc1, their biases, embedding / output rows


def _merged(where: Path, key: str, shards: list[torch.Tensor], rest: str, gated: bool) -> torch.Tensor:
    try:
        return _merge_tp(rest, shards, gated).float()
    except RuntimeError as e:  # TP shards whose other dims differ: torch.cat refuses
        raise CheckpointError(f"{where}: the TP shards of {key} do not fit together ({[list(t.shape) for t in shards]}): "
                              "the checkpoint is damaged or mixed") from None


def from_legacy(src: Path, weights_only: bool) -> Source:
    ranks: dict[tuple[int, int], Path] = {}
    for d in src.iterdir():
        m = RANK_DIR.match(d.name)
        if m and not d.is_dir():
            raise CheckpointError(f"{src}: {d.name} is not a directory (a legacy Megatron-LM checkpoint holds "
                                  f"{d.name}/model_optim_rng.pt): the checkpoint is damaged or not Megatron-LM's")
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / "model_optim_rng.pt"
    tp, pp = 1 + max(t for t, _ in ranks), 1 + max(p for _, p in ranks)
    for t in range(tp):
        for p in range(pp):
            f = ranks.get((t, p), src / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")) / "model_optim_rng.pt")
            if not f.is_file():
                raise CheckpointError(f"{src}: {f.relative_to(src)} is missing (a {tp} x {pp} TP x PP checkpoint)")
            ranks[(t, p)] = f
    states = {k: safe_load(f) for k, f in sorted(ranks.items())}  # one full copy of the model in memory
    for k, v in states.items():
        if not isinstance(v, dict) or not isinstance(v.get("model") or {}, dict):
            raise CheckpointError(f"{ranks[k]} is not a Megatron-LM checkpoint file (a dict with 'args' and 'model')")
    first = states[(0, 0)]
    args = first.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{ranks[(0, 0)]} has no 'args' (Megatron-LM's argparse.Namespace): the model's dims "
                              "are unknown")
    models = {k: v.get("model") or {} for k, v in states.items()}
    opt = next((k for k, v in states.items() if has_tensors(v.get("optimizer"))), None)
    if opt is not None and not weights_only:
        refuse_optimizer_state(ranks[opt], "its 'optimizer' entry")
    dropped = ["Megatron's optimizer state (--weights-only)"] if opt is not None else []
    rest_state = sorted({k for v in states.values() for k in v if k in ("rng_state", "opt_param_scheduler")})
    dropped += [f"Megatron's {' and '.join(rest_state)}"] if rest_state else []
    for (t, p), sd in models.items():
        if p == 0:
            check_core_names(ranks[(t, p)], list(sd))
        bad = next((n for n, v in sd.items() if "_extra_state" not in n and not isinstance(v, torch.Tensor)), None)
        if bad is not None:
            raise CheckpointError(f"{ranks[(t, p)]}: model entry {bad} is a {type(sd[bad]).__name__}, not a tensor")
        if set(sd) != set(models[(0, p)]):  # every TP rank of a stage holds its shard of the same tensors
            odd = sorted(set(sd) ^ set(models[(0, p)]))[0]
            raise CheckpointError(f"{ranks[(t, p)]} and {ranks[(0, p)]} differ in tensor {odd}: the TP ranks of a "
                                  "stage must hold the same tensors; the checkpoint is damaged or mixed")
        stage_layers = {int(x.group(1)) for n in sd if (x := LAYER.match(n))}
        if stage_layers and len(stage_layers) * pp != count(args, src, "num_layers"):
            raise CheckpointError(f"{ranks[(t, p)]} holds {len(stage_layers)} layers, but args.num_layers "
                                  f"{args.num_layers} over {pp} pipeline stages is {args.num_layers / pp:g} per stage: "
                                  "the checkpoint is inconsistent")
    vocab = sum(models[(t, 0)]["embedding.word_embeddings.weight"].shape[0] for t in range(tp))
    pos = models[(0, 0)].get("embedding.position_embeddings.weight")
    info = model_info(args, src, vocab, [n for m in models.values() for n in m], None if pos is None else pos.shape[0])
    per_stage = info["num_layers"] // pp
    full: dict[str, torch.Tensor] = {}
    used: dict[int, set[str]] = {p: set() for p in range(pp)}
    tops, layers = top_shapes(info), layer_shapes(info)
    for name, mname in top_level(info).items():
        stage = 0 if mname.startswith("embedding.") else pp - 1
        if mname not in models[(0, stage)]:
            raise CheckpointError(f"{ranks[(0, stage)]}: no tensor {mname}")
        shards = [models[(t, stage)][mname] for t in range(tp)]
        full[f"param/{name}"] = _merged(src, mname, shards, "embedding" if name in ("embedding.weight", "head.weight")
                                        else "norm1.", False)
        check_shape(src, mname, tuple(full[f"param/{name}"].shape), tops[name])
        used[stage].add(mname)
    last = models[(0, pp - 1)]
    if info["tie_embeddings"] and "output_layer.weight" in last:  # Megatron's copy of a tied head
        head = _merged(src, "output_layer.weight", [models[(t, pp - 1)]["output_layer.weight"] for t in range(tp)],
                       "embedding", False)
        check_tied_head(src, info, head, full["param/embedding.weight"])
        used[pp - 1].add("output_layer.weight")
    for p in range(pp):
        for local in range(per_stage):
            for rest, candidates in per_layer_names(info).items():
                key = next((f"decoder.layers.{local}.{c}" for c in candidates
                            if f"decoder.layers.{local}.{c}" in models[(0, p)]), None)
                if key is None:
                    raise CheckpointError(f"{ranks[(0, p)]}: no tensor decoder.layers.{local}.{candidates[0]}")
                merged = _merged(src, key, [models[(r, p)][key] for r in range(tp)], rest, info["arch"] == "llama")
                check_shape(ranks[(0, p)].parent, f"{key} (merged over TP)", tuple(merged.shape), layers[rest])
                used[p].add(key)
                full[f"param/layers.{p * per_stage + local}.{rest}"] = \
                    ungroup_qkv(merged, info) if rest.startswith("attn.qkv.") else merged
        leftover_tensors(ranks[(0, p)], list(models[(0, p)]), used[p], weights_only)
    return Source(info, {k: tuple(v.shape) for k, v in full.items()}, lambda k: full[k].float(),
                  iteration(first, ranks[(0, 0)]), dropped=dropped)
