"""Sharded checkpoints that load under any layout (tp, pp, dp, vpp, sp, ZeRO stage).

On disk (one directory per step, published atomically, see `megalite.checkpoint.files`):

    <dir>/step_00000100/rank_00000.safetensors ...  one file per rank, written in parallel, no gather
    <dir>/step_00000100/index.json                   every logical tensor: global shape + its slabs,
                                                     per-file sha256, model dims, layout, `extra`
    <dir>/latest                                     name of the newest complete checkpoint

What is stored: for every parameter its fp32 value ("param/<name>"; the optimizer's fp32 master copy
when it keeps one) and, once the optimizer has stepped, its Adam moments ("exp_avg/<name>",
"exp_avg_sq/<name>"), each in its GLOBAL, UNPADDED shape: vocabulary rows stop at the real
vocab_size, so the padding that depends on tp never reaches the disk (it is re-created, as zeros, on
load). Names are the model's global, layout-independent parameter names.

Who writes what: a logical tensor lives on one pipeline stage; a TP-split tensor is written by every tp
rank of that stage (its own slice), a replicated one (norms, biases of row layers, positions) by tp
rank 0 only. Within a dp x cp group (the ranks holding the same parameters) the tensors are dealt out
round-robin (tensor j by its rank j % (dp*cp)), so all ranks write at once and every byte is written exactly
once. Nothing stored depends on cp (every cp rank holds the same parameters; ZeRO's shards over dp x cp are
gathered into whole tensors first), so a checkpoint saved at any cp loads at any other. A tied head on the
last pipeline stage is a copy of `embedding.weight` and is not written. Every rank's file also holds its RNG states.

`extra` (config, sampler position, loss scaler...) is JSON and comes from rank 0; `extra["rng"]` is
per rank (tensors) and restored only when the layout (tp, cp, pp, dp, sp, vpp) is unchanged: on another
layout the ranks hold different pieces and draw different masks anyway, so the freshly seeded RNG
streams of the new run are kept (load returns `rng=None`). This only matters with dropout > 0.

Of the optimizer (`megalite.optim.protocol.DistributedOptimizer`) this uses `stage` (recorded in the
index) and its checkpoint half:
    param_states() -> {global name: {"exp_avg", "exp_avg_sq" (local TP shard, fp32), "step",
                       optionally "master" (fp32 param)}}   ({} before the first step)
    load_param_states({global name: {"master", and "exp_avg", "exp_avg_sq", "step" when the
                       checkpoint has optimizer state}})    (no "exp_avg": start that param fresh)
How each parameter is cut over TP comes from its `ParamSpec` (`megalite.parallel.param_spec`); saving
or loading a model with a parameter that has none fails with a CheckpointError naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.checkpoint.layout import Piece, ShardMap, model_info, shard_map
from megalite.checkpoint.files import (LATEST, fsync_dir, make_fresh_dir, open_no_link, prune,
                                      refuse_foreign_file, refuse_link, sha256, step_dir_name, write_atomic)
from megalite.checkpoint.locate import FORMAT, INDEX, find, read_index  # noqa: F401 (their old home)
from megalite.checkpoint.storage import SlabReader, StreamingWriter
from megalite.errors import CheckpointError
from megalite.checkpoint.moe_layout import expert_shard_map, routing_buffers
from megalite.mla.config import MLAConfig
from megalite.mtp.metrics import PredictsTokensAhead
from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel.param_spec import ParamSpec, Tied, logical_name, named_param_specs
from megalite.parallel.state import GroupKind, ParallelState

SAME_PARAMS: GroupKind = "dp_cp"  # the ranks holding the same parameters, among which the writes are dealt
STATE_KINDS = ("exp_avg", "exp_avg_sq")
MODEL_KEYS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "tie_embeddings")
LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "sp", "vpp")


def _chunks(model_chunks: nn.Module | list[nn.Module]) -> list[nn.Module]:
    if isinstance(model_chunks, nn.ModuleList):
        return list(model_chunks)
    return [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)


def _barrier(state: ParallelState) -> None:
    if state.world_size > 1:
        dist.barrier()


def _params(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter, str, ParamSpec]]:
    """(global name, parameter, name of the stored tensor it comes from, spec); a tied head copy comes
    from `embedding.weight`. Raises a CheckpointError naming any parameter without a spec."""
    out: list[tuple[str, nn.Parameter, str, ParamSpec]] = []
    for chunk in chunks:
        specs = named_param_specs(chunk, CheckpointError)
        for name, p in chunk.named_parameters():
            spec = specs[name]
            source = "embedding.weight" if spec.tied is Tied.HEAD_COPY else logical_name(name)
            out.append((logical_name(name), p, source, spec))
    return out


def stored_shapes(model_chunks: nn.Module | list[nn.Module]) -> dict[str, tuple[int, ...]]:
    """The logical tensors a checkpoint of this model holds ("param/<name>", "buffer/<name>") and their global,
    unpadded shapes: what a converter's output must hold exactly for `load_sharded` to take it (the model
    may live on the meta device)."""
    chunks = _chunks(model_chunks)
    vocab = model_info(chunks[0].cfg)["vocab_size"]
    out = {f"param/{name}": shard_map(name, tuple(p.shape), spec.layout, 1, 0, vocab).global_shape
           for name, p, _, spec in _params(chunks) if spec.tied is not Tied.HEAD_COPY}
    out.update({f"buffer/{name}": tuple(b.shape) for name, b in routing_buffers(chunks)})
    return out


def _layout(state: ParallelState, chunks: list[nn.Module],
            optimizer: DistributedOptimizer | None) -> dict[str, Any]:
    return {"tp": state.tp, "cp": state.cp, "pp": state.pp, "dp": state.dp, "sp": bool(state.sp),
            "vpp": len(chunks),
            "zero": optimizer.stage if optimizer is not None else 0}


def _local(t: torch.Tensor, smap: ShardMap, i: int) -> torch.Tensor:
    piece = smap.pieces[i]
    return t[tuple(slice(a, a + n) for a, n in zip(piece.local, piece.shape))]


def _write_json(path: Path, obj: Any) -> None:
    with open_no_link(path, "w", exclusive=True) as f:  # a new file inside megalite's own temp directory
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path, keep: int | None = None) -> None:
    """Rename a complete temp directory into place; with `keep`, move `latest` (last) and prune.
    A link at `final` or `latest` is refused (files.refuse_link), never followed or replaced."""
    refuse_link(final)
    if keep is not None:
        refuse_link(final.parent / LATEST, hard_links=False)  # before the step is published: all or nothing
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if keep is None:
        return
    write_atomic(final.parent / LATEST, (final.name + "\n").encode())
    prune(final.parent, keep, final.name)


def _json_extra(extra: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in extra.items() if k != "rng"}
    try:
        json.dumps(rest)
    except TypeError as e:
        raise CheckpointError(f"checkpoint extra state must be JSON (plain numbers, strings, lists, dicts): {e}; "
                              "convert tensors with .tolist() before saving") from e
    return rest


def save_sharded(root: str | Path, step: int, model_chunks: nn.Module | list[nn.Module],
                 optimizer: DistributedOptimizer | None, extra: dict[str, Any], state: ParallelState,
                 keep: int) -> Path:
    """Every rank calls this; each writes only its own slices. Returns the published step directory."""
    return write_planned(plan_save(root, step, model_chunks, optimizer, extra, state, keep),
                         lambda: _barrier(state))


@dataclass
class SavePlan:
    """One rank's share of a checkpoint, ready to be written by `write_planned` (on any thread).

    `slabs` are (safetensors key, tensor) in file order; `snapshot` replaces them by host copies so the
    training loop may go on changing the live tensors while the copies are written (async save)."""

    base: Path
    step: int
    keep: int
    rank: int
    world_size: int
    file: str
    slabs: list[tuple[str, torch.Tensor]]
    tensors: dict[str, Any]         # this rank's index entries
    opt_step: float | None
    rng_keys: list[str]
    head: dict[str, Any]            # the index's common part (rank 0 writes it)


def plan_save(root: str | Path, step: int, model_chunks: nn.Module | list[nn.Module],
              optimizer: DistributedOptimizer | None, extra: dict[str, Any], state: ParallelState,
              keep: int) -> SavePlan:
    """What this rank writes for step `step` (main thread: may gather ZeRO shards collectively)."""
    chunks = _chunks(model_chunks)
    info = _model_info(chunks)
    params = _params(chunks)
    pstates = optimizer.param_states() if optimizer is not None else {}
    # The writes are dealt among the ranks holding the same values (`GradReduction.group`: dp x cp for a
    # dense weight, the experts' own group for MoE experts), so each slab is written once.
    dealt: dict[GroupKind, list[tuple[str, ShardMap, torch.Tensor]]] = {SAME_PARAMS: []}
    opt_step: float | None = None
    for name, p, _, spec in params:
        if spec.tied is Tied.HEAD_COPY or (not spec.layout.split and state.tp_rank != 0):
            continue
        smap = expert_shard_map(shard_map(name, tuple(p.shape), spec.layout, state.tp, state.tp_rank,
                                          info["vocab_size"]), spec, state)
        st = pstates.get(name, {})
        group = dealt.setdefault(spec.grads.group, [])
        group.append((f"param/{name}", smap, st.get("master", p)))
        group += [(f"{kind}/{name}", smap, st[kind]) for kind in STATE_KINDS if kind in st]
        if "step" in st:
            opt_step = float(st["step"])
    if state.tp_rank == 0:  # MoE routers' bias: not a parameter, but routing depends on it
        dealt[SAME_PARAMS] += [(f"buffer/{name}", ShardMap(tuple(b.shape), tuple(b.shape),
                                                           (Piece((0,), (0,), tuple(b.shape)),)), b)
                               for name, b in routing_buffers(chunks)]
    mine = [item for group, items in dealt.items() for item in items[state.rank_in(group)::state.size(group)]]
    rng: dict[str, torch.Tensor] = extra.get("rng") or {}
    file = f"rank_{state.rank:05d}.safetensors"
    slabs = [(f"{key}/{i}", _local(t.detach(), smap, i)) for key, smap, t in mine for i in range(len(smap.pieces))]
    slabs += [(f"rng/{k}", v.to("cpu", torch.uint8)) for k, v in rng.items()]
    tensors = {key: {"shape": list(smap.global_shape), "dtype": "float32",
                     "slabs": [{"file": file, "key": f"{key}/{i}", "offset": list(pc.glob),
                                "shape": list(pc.shape)} for i, pc in enumerate(smap.pieces)]}
               for key, smap, _ in mine}
    head = {"format": FORMAT, "step": step, "layout": _layout(state, chunks, optimizer), "model": info,
            "extra": _json_extra(extra)}
    return SavePlan(Path(root), step, keep, state.rank, state.world_size, file, slabs, tensors, opt_step,
                    sorted(rng), head)


def write_planned(plan: SavePlan, barrier: Callable[[], None]) -> Path:
    """Write `plan` into step_N.tmp, then (rank 0, after `barrier`: every rank's file is durable) merge the
    index, rename the directory and move `latest`. Every rank calls it with a barrier over all ranks."""
    base, file, rank = plan.base, plan.file, plan.rank
    final, tmp = base / step_dir_name(plan.step), base / (step_dir_name(plan.step) + ".tmp")
    entries = [(key, torch.uint8 if key.startswith("rng/") else torch.float32, tuple(t.shape))
               for key, t in plan.slabs]
    try:
        for path in (final, tmp):  # every rank, so on a shared file system none waits at a barrier for rank 0
            refuse_foreign_file(path)
        if rank == 0:
            make_fresh_dir(tmp)  # leftovers of a crashed save go; a link planted there is refused
        barrier()
        writer = StreamingWriter(tmp / file, entries)
        try:
            with torch.no_grad():
                for (key, t), (_, dtype, _) in zip(plan.slabs, entries):
                    writer.write(key, t.to(dtype))
        except BaseException:
            writer.abort()
            raise
        writer.close()
        _write_json(tmp / f"rank_{rank:05d}.json",
                    {"file": file, "sha256": sha256(tmp / file), "tensors": plan.tensors,
                     "optimizer_step": plan.opt_step, "rng": plan.rng_keys})
    except BaseException as e:
        _remove_partial(tmp, file, rank)  # a failed save must not keep the disk full
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint under {base}: {e.strerror or e} "
                                  "(check the directory is writable and the disk has space)") from e
        raise
    barrier()
    if rank == 0:
        try:
            _merge_index(tmp, plan.world_size, plan.head)
            publish(tmp, final, plan.keep)
        except BaseException as e:  # the same CheckpointError line whether the save runs in the background or not
            if not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)  # megalite's own step_N.tmp: never left behind
            if isinstance(e, OSError):
                raise CheckpointError(f"cannot publish checkpoint {final}: {e.strerror or e} (check the directory "
                                      "is writable and the disk has space)") from e
            raise
    barrier()
    return final



def _remove_partial(tmp: Path, file: str, rank: int) -> None:
    """Delete this rank's partial files of a failed save; rank 0 also the (megalite-made) step_N.tmp."""
    for leftover in (tmp / file, tmp / f"rank_{rank:05d}.json"):
        try:
            leftover.unlink(missing_ok=True)
        except OSError:
            pass  # nothing to remove, or the directory itself is gone
    if rank == 0 and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)


def _merge_index(tmp: Path, world_size: int, head: dict[str, Any]) -> None:
    """Rank 0 combines the per-rank slab lists (small JSON, via the file system) into index.json."""
    index: dict[str, Any] = dict(head, files={}, rng_files={}, rng_keys=[], optimizer_step=None, tensors={})
    for r in range(world_size):
        part_path = tmp / f"rank_{r:05d}.json"
        part = json.loads(part_path.read_text())
        index["files"][part["file"]] = part["sha256"]
        if part["rng"]:
            index["rng_files"][str(r)] = part["file"]
            index["rng_keys"] = part["rng"]
        if part["optimizer_step"] is not None:
            index["optimizer_step"] = part["optimizer_step"]
        for key, entry in part["tensors"].items():
            have = index["tensors"].setdefault(key, dict(entry, slabs=[]))
            if have["shape"] != entry["shape"]:
                raise CheckpointError(f"ranks disagree on the global shape of {key}: {have['shape']} vs "
                                      f"{entry['shape']} (a megalite bug, please report)")
            have["slabs"] += entry["slabs"]
        part_path.unlink()
    _write_json(tmp / INDEX, index)


def _model_info(chunks: list[nn.Module]) -> dict[str, Any]:
    """The model's recorded dimensions, with its multi-token prediction depth when it has modules (docs/mtp.md)."""
    info = model_info(chunks[0].cfg, cast(MLAConfig | None, chunks[0].mla))
    depth = max((c.mtp_depth for c in chunks if isinstance(c, PredictsTokensAhead)), default=0)
    if depth:
        info["mtp_layers"] = depth
    return info


def check_mtp(saved: dict[str, Any], mine: dict[str, Any], path: Path) -> None:
    """A resumed run keeps the checkpoint's multi-token prediction modules (a load for generation, or
    `train.init_from`, may leave them out)."""
    theirs, ours = saved.get("mtp_layers", 0), mine.get("mtp_layers", 0)
    if theirs != ours:
        raise CheckpointError(f"checkpoint {path} was trained with mtp.num_layers={theirs} but this run has {ours}: "
                              f"set mtp.num_layers={theirs} to resume it (or start from its weights with "
                              "train.init_from)")


def check_model(saved: dict[str, Any], mine: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model shape, naming every dimension that differs."""
    diff = [k for k in MODEL_KEYS if k in saved and k in mine and saved[k] != mine[k]]
    diff += ["mla"] if saved.get("mla") != mine.get("mla") else []  # recorded only when on: absent = off
    if diff:
        theirs = ", ".join(f"{k}={saved.get(k)}" for k in diff)
        ours = ", ".join(f"{k}={mine.get(k)}" for k in diff)
        raise CheckpointError(f"checkpoint {path} is of a different model ({theirs}; this run has {ours}): "
                              "set model.* (and mla.*) to the checkpointed model's values")


def load_sharded(path: str | Path, model_chunks: nn.Module | list[nn.Module],
                 optimizer: DistributedOptimizer | None, state: ParallelState,
                 weights_only: bool = False) -> dict[str, Any]:
    """Load this rank's shards at the current layout; returns `extra` plus step, rng (None when the layout
    changed) and has_optimizer_state. Reads only the slab regions that overlap this rank's shards.
    `weights_only`: the parameters alone (the optimizer's master weights set from them, its moments left
    fresh), for `train.init_from`."""
    path = Path(path)
    chunks = _chunks(model_chunks)
    params = _params(chunks)
    info = _model_info(chunks)
    index = read_index(path)
    check_model(index.get("model", {}), info, path)
    if optimizer is not None and not weights_only:
        check_mtp(index.get("model", {}), info, path)
    reader = SlabReader(path, index)
    has_opt = any(k.startswith("exp_avg/") for k in index["tensors"]) and not weights_only
    states: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, p, source, spec in params:
            if weights_only and new_module(name, index.get("model", {})) and not reader.has(f"param/{source}"):
                # As built (the model's init is TP-invariant, so every layout agrees), its master weights too.
                states[name] = {"master": p.detach().to(torch.float32).clone()}
                continue
            smap = expert_shard_map(shard_map(name, tuple(p.shape), spec.layout, state.tp, state.tp_rank,
                                              info["vocab_size"]), spec, state)
            key = f"param/{source}"
            if reader.has(key) and reader.shape(key) != smap.global_shape:
                raise CheckpointError(f"checkpoint {path}: tensor {source} has shape {list(reader.shape(key))} but "
                                      f"this model's is {list(smap.global_shape)}: set model.* to the checkpointed "
                                      "model's values")
            kinds = ("param",) + (STATE_KINDS if has_opt and optimizer is not None else ())
            for kind in kinds:
                if kind != "param" and not reader.has(f"{kind}/{source}"):
                    continue  # this parameter had no optimizer state yet: it starts fresh
                local = torch.zeros(smap.local_shape, dtype=torch.float32)  # padding rows stay zero
                for i, pc in enumerate(smap.pieces):
                    local[tuple(slice(a, a + n) for a, n in zip(pc.local, pc.shape))] = \
                        reader.read_region(f"{kind}/{source}", pc.glob, pc.shape)
                if kind == "param":
                    p.copy_(local.to(p.dtype))
                    states.setdefault(name, {})["master"] = local.to(p.device)
                else:
                    states[name][kind] = local.to(p.device)
            if "exp_avg" in states[name]:
                states[name]["step"] = torch.tensor(float(index["optimizer_step"] or 0.0))
        for name, buf in routing_buffers(chunks):
            if reader.has(f"buffer/{name}"):
                buf.copy_(reader.read_region(f"buffer/{name}", (0,), tuple(buf.shape)))
    if optimizer is not None:
        optimizer.load_param_states(states)
    saved = index.get("layout", {})
    now = _layout(state, chunks, optimizer)
    rng = None
    same_layout = all(saved.get(k, 1 if k == "cp" else None) == now[k] for k in LAYOUT_KEYS)  # no "cp": 1
    if same_layout and str(state.rank) in index.get("rng_files", {}):
        file = index["rng_files"][str(state.rank)]
        rng = {k: reader.read_file_tensor(file, f"rng/{k}") for k in index["rng_keys"]}
    reader.close()
    theirs, ours = int(index.get("model", {}).get("mtp_layers", 0) or 0), int(info.get("mtp_layers", 0))
    return dict(index.get("extra", {}), step=int(index["step"]), rng=rng, has_optimizer_state=has_opt,
                fresh=[f"mtp.layers.{k}" for k in range(theirs, ours)],
                left=[f"mtp.layers.{k}" for k in range(ours, theirs)])


def new_module(name: str, saved: dict[str, Any]) -> bool:
    """Whether parameter `name` belongs to a module the checkpoint's model does not have, which a run from its
    weights (`train.init_from`) adds: a multi-token prediction depth beyond the checkpoint's (docs/mtp.md)."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["mtp", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= int(saved.get("mtp_layers", 0) or 0))
