"""torch.distributed.checkpoint (DCP) as an exchange format: a megalite checkpoint to plain DCP and back.

A DCP directory (`.metadata` + `__<rank>_<n>.distcp` files, written by `torch.distributed.checkpoint.save`) is
what torchtitan, torchtune and the other DCP-aware tools load. megalite writes it from one process with full,
unpadded tensors, in the nested form torch's own `get_state_dict` produces, so any tool loads it with
`dcp.load` (at any sharding: DCP reshards on load) and `set_optimizer_state_dict`:

    {"model":     {<megalite name>: fp32 tensor, ...},           (parameters, and buffers: a MoE router's bias)
     "optimizer": {"state": {<name>: {"exp_avg", "exp_avg_sq", "step"}},      (once the optimizer has stepped;
                             a Muon matrix: {"momentum_buffer", "step"}, torch.optim.Muon's name)
                   "param_groups": [{"params": [<name>, ...], "lr", "betas", "eps", "weight_decay"}]},
     "megalite":  JSON string: model dims, step, optimizer step, extra (config, sampler position, scaler),
                  buffers (which "model" entries are buffers); checked field by field when read}

Names are megalite's (`megalite.checkpoint.hf` lists them); a tied head is not stored (it is the embedding).
Guarantees: the directory is written under a temporary name, fsynced (DCP's `sync_files`) and renamed, so a
crash never leaves a partial `out`; megalite adds `megalite.sha256.json` (the sha256 of every file) and checks
it, and that every file `.metadata` names exists, before reading. Reading runs no code from the files (every DCP
input, torchtitan's and Megatron's torch_dist included, may come from anyone): torch's own reader unpickles
`.metadata` with plain `pickle` and non-tensor entries with `torch.load(weights_only=False)`, either of which
runs whatever a crafted file asks; here `.metadata` is unpickled with only DCP's metadata classes allowed and
non-tensor entries with `weights_only=True` (a file needing anything else is refused, naming the class). Other tools ignore that file and get plain
DCP (their own loaders do not verify checksums). The training run itself always writes megalite's format
(per-rank writes, any-layout loads); DCP is produced and read by `tools/convert_checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from megalite.checkpoint.files import fsync_dir, fsync_file, inside, sha256, temp_name
from megalite.checkpoint.index_check import MAX_COUNT, model_info_problems
from megalite.checkpoint.interop.dcp_metadata import metadata_problems
from megalite.checkpoint.interop.source import KINDS, Source, claim, optimizer_kind, refuse_moments_without_adam
from megalite.config.aliases import saved_config
from megalite.errors import CheckpointError
from megalite.untrusted import load_json_file, loads_json

META_KEY = "megalite"
SUMS = "megalite.sha256.json"
_STATES = ("exp_avg", "exp_avg_sq")


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it runs without a process group: that is the intent here (one process, no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_dcp(out: Path, state_dict: dict[str, Any], side_files: dict[str, str] | None = None) -> Path:
    """`dcp.save` into a temporary directory next to `out`, add `side_files` (name -> text) and the checksums,
    rename to `out`."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"output {out} already exists: choose a new directory or delete it first")
    tmp = temp_name(out)
    try:
        tmp.mkdir(parents=True)
        with _one_process():
            dcp.save(state_dict, checkpoint_id=str(tmp), no_dist=True)
        for name, text in (side_files or {}).items():
            (tmp / name).write_text(text)
            fsync_file(tmp / name)
        sums = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / SUMS).write_text(json.dumps(sums, indent=1))
        fsync_file(tmp / SUMS)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # only what this call created
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write {out} ({e.strerror or e}): choose a writable location") from e
        raise
    return out


# What a DCP `.metadata` pickle legitimately names: DCP's metadata dataclasses, its storage records, its save
# plans (megatron-core keeps every rank's plan in `all_local_plans`), torch.Size, dtypes and layouts, and the
# checkpoint id's path class. Constructing any of them runs no user code.
_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "ChunkStorageMetadata", "BytesStorageMetadata", "TensorStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {("torch.distributed.checkpoint.planner", n) for n in (
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                       torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def _refused(path: Path, e: pickle.UnpicklingError) -> CheckpointError:
    found = re.search(r"GLOBAL ([\w.]+)", str(e))  # ours and torch.load's weights_only message both say so
    what = found.group(1) if found else (str(e).splitlines() or ["an unknown object"])[0]
    return CheckpointError(f"{path} needs {what} to be unpickled, which a torch.distributed.checkpoint file does "
                           "not: refusing to run code from it (the file was crafted or is not a checkpoint)")


class SafeReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` unpickled by the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise _refused(path, e) from None
        if not isinstance(md, Metadata):
            raise CheckpointError(f"{path} holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
        problems = metadata_problems(md)
        if problems:
            raise CheckpointError(f"{path} is not a valid torch.distributed.checkpoint index ({'; '.join(problems)}): "
                                  "the file was edited, damaged or crafted; restore the checkpoint from a copy")
        storage = getattr(md, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id  # what torch's reader does after unpickling
        md.storage_meta = storage
        return md


class _SafePlanner(DefaultLoadPlanner):
    """Non-tensor entries through `torch.load(weights_only=True)` (torch's planner: weights_only=False);
    megalite reads them only at the top level of the state dict (`load_object`)."""

    def __init__(self, src: Path) -> None:
        super().__init__()
        self.src = src

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        path = self.mappings.get(fqn, (fqn,))
        if len(path) != 1:  # load_tensor asked for a tensor there
            raise CheckpointError(f"{self.src}: entry {fqn} is stored as an object, not a tensor: the checkpoint "
                                  "is damaged or not of the expected kind")
        try:
            self.original_state_dict[str(path[0])] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(self.src / f"{fqn} (an entry of its .distcp files)", e) from None


def read_metadata(src: Path) -> Metadata:
    """The `.metadata` of DCP directory `src`, after checking every data file it names exists (the missing one
    is named) and, when `megalite.sha256.json` is there, that every file matches its checksum."""
    src = Path(src)
    if not (src / ".metadata").is_file():
        raise CheckpointError(f"{src} is not a torch.distributed.checkpoint directory (no .metadata file)")
    try:
        md = SafeReader(str(src)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign .metadata: torch raises pickle/EOF errors of many kinds
        raise CheckpointError(f"cannot read {src / '.metadata'} ({type(e).__name__}: {e}): the checkpoint is "
                              "damaged or incomplete") from e
    files = sorted({info.relative_path for info in md.storage_data.values()})  # a dict (`metadata_problems`)
    for name in files:
        if not inside(src, name, ".metadata").is_file():
            raise CheckpointError(f"{src}: shard file {name} named in .metadata is missing: the checkpoint is "
                                  "incomplete (copy it completely, or re-save it)")
    if (src / SUMS).is_file():
        sums = load_json_file(src / SUMS, str(src / SUMS), CheckpointError)
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise CheckpointError(f"{src / SUMS} is not a JSON object of file names and sha256 digests")
        for name, digest in sums.items():
            if sha256(inside(src, name, SUMS)) != digest:
                raise CheckpointError(f"{src / name} is corrupt (sha256 mismatch with {SUMS}): restore it from a copy")
    return md


def tensor_shapes(md: Metadata) -> dict[str, tuple[int, ...]]:
    """Flattened DCP key ("model.layers.0.attn.qkv.weight") -> shape, for every tensor in the checkpoint."""
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _load(src: Path, state_dict: dict[str, Any]) -> None:
    """`dcp.load` into `state_dict` through the safe reader and planner. DCP wraps what a read raises in a
    CheckpointException (a BaseException, with the original inside): ours comes back out as it was, anything
    else (a size or type that contradicts `.metadata`) as one CheckpointError line."""
    try:
        with _one_process():
            dcp.load(state_dict, storage_reader=SafeReader(str(src)), planner=_SafePlanner(src), no_dist=True)
    except CheckpointException as e:
        inner = next((exc for exc, _ in e.failures.values()), None)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"cannot read {src} ({type(inner).__name__}: {inner}): the checkpoint is damaged or "
                              "does not match its .metadata") from None


def load_tensor(src: Path, path: list[str], shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor of a DCP checkpoint, by its nested key path: memory stays at one tensor."""
    t = torch.empty(shape, dtype=dtype)
    nested: dict[str, Any] = {path[-1]: t}
    for part in reversed(path[:-1]):
        nested = {part: nested}
    _load(src, nested)
    return t


def load_object(src: Path, key: str) -> Any:
    holder: dict[str, Any] = {key: ""}
    _load(src, holder)
    return holder[key]


def to_dcp(source: Source, out: Path) -> Path:
    """Write `source` as a plain DCP directory `out` in megalite's names (memory: the whole model, as
    `dcp.save` takes one state dict). Every tensor is carried: parameters and buffers (a MoE router's bias) in
    "model", as torch's own state dict holds persistent buffers; AdamW's moments as torch's AdamW names them;
    Muon's momentum (on the matrices whose "exp_avg_sq" Muon never touches) as torch.optim.Muon names it,
    "momentum_buffer", so no AdamW loads it as a first moment."""
    try:
        kind = optimizer_kind(source.extra)
        claim(source.shapes, {k for k in source.shapes if k.split("/", 1)[0] in KINDS}, "DCP")
        full = {k: source.fetch(k) for k in source.shapes}
    finally:
        source.close()
    if kind == "adamw":
        refuse_moments_without_adam(full, "DCP (in torch's AdamW names)")
    params = {k.split("/", 1)[1]: t for k, t in full.items() if k.startswith("param/")}
    buffers = {k.split("/", 1)[1]: t for k, t in full.items() if k.startswith("buffer/")}
    step = torch.tensor(float(source.optimizer_step or 0.0))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name in params:
        if f"exp_avg/{name}" not in full:
            continue
        m, v = full[f"exp_avg/{name}"], full[f"exp_avg_sq/{name}"]
        moments = {"momentum_buffer": m} if kind == "muon" and not v.any() else {"exp_avg": m, "exp_avg_sq": v}
        state[name] = {**moments, "step": step.clone()}
    config = saved_config(source.extra)
    train, opt = config.get("train", {}), config.get("optimizer", {})
    group = {"params": list(params), "lr": float(train.get("lr", 0.0)),
             "betas": (float(opt.get("beta1", 0.9)), float(opt.get("beta2", 0.95))),
             "eps": float(opt.get("adam_eps", 1e-8)), "weight_decay": float(opt.get("weight_decay", 0.0))}
    meta = {"format": "megalite-dcp-1", "model": source.info, "step": source.step,
            "optimizer_step": source.optimizer_step, "extra": source.extra, "buffers": sorted(buffers)}
    return save_dcp(out, {"model": {**params, **buffers}, "optimizer": {"state": state, "param_groups": [group]},
                          META_KEY: json.dumps(meta)})


def _meta_problems(meta: Any) -> list[str]:
    """What makes the '{META_KEY}' entry unusable (each value a megalite checkpoint must hold), one phrase each."""
    if not isinstance(meta, dict):
        return [f"it is a JSON {type(meta).__name__}, not an object"]
    out = [f"model: {p}" for p in model_info_problems(meta.get("model"))]
    step, opt = meta.get("step"), meta.get("optimizer_step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT:
        out.append(f"step={step!r} must be an integer in [0, 2^62]")
    if opt is not None and (isinstance(opt, bool) or not isinstance(opt, (int, float)) or not 0 <= opt <= MAX_COUNT):
        out.append(f"optimizer_step={opt!r} must be a number in [0, 2^62]")
    if not isinstance(meta.get("extra") or {}, dict):
        out.append(f"extra={meta.get('extra')!r} must be a JSON object")
    buffers = meta.get("buffers", [])
    if not (isinstance(buffers, list) and all(isinstance(b, str) for b in buffers)):
        out.append(f"buffers={buffers!r} must be a list of tensor names")
    return out


def from_dcp(src: Path) -> Source:
    """A DCP directory written by `to_dcp` (or any with the same keys and a '{META_KEY}' entry)."""
    md = read_metadata(src)
    if META_KEY not in md.state_dict_metadata:
        raise CheckpointError(f"{src} is a DCP checkpoint without megalite's '{META_KEY}' entry (model dims): "
                              "for a torchtitan checkpoint use --from torchtitan")
    text = load_object(src, META_KEY)
    if not isinstance(text, str):
        raise CheckpointError(f"{src}: its '{META_KEY}' entry is not the JSON megalite writes (model dims, step): "
                              "the checkpoint was not written by tools/convert_checkpoint.py or was edited")
    try:
        meta = loads_json(text, f"{src}'s '{META_KEY}' entry", CheckpointError)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{src}: its '{META_KEY}' entry is not valid JSON ({e.msg}): the checkpoint was "
                              "edited or damaged") from None
    problems = _meta_problems(meta)
    if problems:
        raise CheckpointError(f"{src}: its '{META_KEY}' entry is not the JSON megalite writes ({'; '.join(problems)}): "
                              "the checkpoint was not written by tools/convert_checkpoint.py or was edited")
    extra = meta.get("extra") or {}
    shapes, where = logical_keys(tensor_shapes(md), set(meta.get("buffers", [])), src)
    if any(w[-1] == "momentum_buffer" for w in where.values()) and optimizer_kind(extra) != "muon":
        raise CheckpointError(f"{src}: it holds Muon momentum (momentum_buffer) but its run config's optimizer is "
                              f"{optimizer_kind(extra)}: the checkpoint is inconsistent; convert with --weights-only")

    def fetch(key: str) -> torch.Tensor:
        path = where[key]
        return torch.zeros(shapes[key]) if not path else load_tensor(src, path, shapes[key])

    return Source(meta["model"], shapes, fetch, int(meta["step"]), meta.get("optimizer_step"), extra)


def logical_keys(flat: dict[str, tuple[int, ...]], buffers: set[str],
                 src: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, list[str]]]:
    """megalite's logical keys ("param/<name>", "buffer/<name>", "exp_avg/<name>") of a megalite-layout DCP, and
    each one's nested DCP path ([] for the zeros of a Muon matrix's "exp_avg_sq"). A tensor of any other key is
    refused: converting without it would change the model or its optimizer without a word."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, list[str]] = {}
    for key, shape in flat.items():
        if key.startswith("model."):
            name = key[len("model."):]
            kind = "buffer" if name in buffers else "param"
            shapes[f"{kind}/{name}"], where[f"{kind}/{name}"] = shape, ["model", name]
            continue
        name, _, kind = key[len("optimizer.state."):].rpartition(".")
        if not key.startswith("optimizer.state.") or kind not in _STATES + ("momentum_buffer", "step"):
            raise CheckpointError(f"{src}: tensor {key} has no place in a megalite checkpoint (model, AdamW moments, "
                                  "Muon momentum): refusing to drop it")
        if kind in _STATES:
            shapes[f"{kind}/{name}"], where[f"{kind}/{name}"] = shape, ["optimizer", "state", name, kind]
        elif kind == "momentum_buffer":  # Muon: its momentum in megalite's "exp_avg" slot, "exp_avg_sq" zero
            shapes[f"exp_avg/{name}"], where[f"exp_avg/{name}"] = shape, ["optimizer", "state", name, kind]
            shapes[f"exp_avg_sq/{name}"], where[f"exp_avg_sq/{name}"] = shape, []
    stray = sorted(k for k in shapes if not k.startswith(("param/", "buffer/"))
                   and f"param/{k.split('/', 1)[1]}" not in shapes)
    if stray:
        raise CheckpointError(f"{src}: optimizer state {stray[0]} belongs to no parameter of the model: the "
                              "checkpoint is damaged or edited")
    return shapes, where
