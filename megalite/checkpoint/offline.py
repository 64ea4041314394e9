"""Offline checkpoint writing (CPU, one process): resharding, and the Hugging Face importer's output.

`write_checkpoint` lays a set of full logical tensors out as a target layout would have saved them:
one file per (tp rank, pipeline rank) of dp group 0, each tensor cut by the same `shard_map` a live
rank uses. All output headers are planned from the shapes first, then tensors stream through one at a
time (`fetch(key)` -> full tensor -> slices appended to their files), so memory stays near the largest
tensor whatever the model size. The result is an ordinary sharded checkpoint directory: it loads
under any layout, and under the target layout each rank reads exactly one file.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megalite.checkpoint.layout import layout_for, local_shape_for, shard_map, stage_of
from megalite.checkpoint.files import refuse_output_in_checkpoint, sha256, temp_name
from megalite.checkpoint.moe_layout import shared_expert_layout
from megalite.checkpoint.sharded import FORMAT, INDEX, _write_json, publish, read_index
from megalite.checkpoint.storage import SlabReader, StreamingWriter
from megalite.errors import CheckpointError
from megalite.parallel.state import layout_grid
from megalite.observability.progress import Progress


@dataclass(frozen=True)
class Target:
    """The layout a checkpoint is written for: one file per (tp rank, pipeline rank) of dp group 0."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    pp_layers: list[int] | None = None


@dataclass(frozen=True)
class Carried:
    """What a written checkpoint holds besides its tensors: the extra state, the step, the optimizer's step."""

    extra: dict[str, Any] | None = None
    step: int = 0
    optimizer_step: float | None = None


def write_checkpoint(out: Path, shapes: dict[str, tuple[int, ...]], fetch: Callable[[str], torch.Tensor],
                     info: dict[str, Any], target: Target = Target(), carried: Carried = Carried(),
                     show_progress: bool = True) -> Path:
    """Write logical tensors `shapes` ("param/<name>", "exp_avg/<name>", ...) as a `target` layout checkpoint.

    The directory is built under this process's own temporary name next to `out` (`.out.tmp-<pid>`) and
    renamed to `out` when complete; on any error only that temporary directory is removed (an existing
    `out` is an error, never overwritten).
    """
    out = Path(out)
    refuse_output_in_checkpoint(out)
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"output {out} already exists: choose a new directory or delete it first")
    tmp = temp_name(out)  # this process's own name: a user's `out.tmp` is never touched
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output {out} ({e.strerror or e}): choose a writable location "
                              "that is not under a file") from e
    try:
        _write_into(tmp, out, shapes, fetch, info, target, carried, show_progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only what this call created
        raise
    return out


def _write_into(tmp: Path, out: Path, shapes: dict[str, tuple[int, ...]], fetch: Callable[[str], torch.Tensor],
                info: dict[str, Any], target: Target, carried: Carried, show_progress: bool) -> None:
    tp, pp, vpp, pp_layers = target.tp, target.pp, target.vpp, target.pp_layers
    plan: dict[str, list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]] = {}  # key -> (file, slab, glob, shape)
    files: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
    for r in range(tp * pp):
        files[f"rank_{r:05d}.safetensors"] = []
    ranks = layout_grid(tp=tp, pp=pp)  # the written layout: dp = cp = 1
    for key, shape in shapes.items():
        name = key.split("/", 1)[1]
        layout = shared_expert_layout(name, shape, info["arch"]) or layout_for(name, info)
        stage = stage_of(name, info["num_layers"], pp, vpp, pp_layers)
        plan[key] = []
        for tp_rank in range(tp if layout.split else 1):
            smap = shard_map(name, local_shape_for(name, shape, layout, tp, info), layout, tp, tp_rank,
                             info["vocab_size"])
            if smap.global_shape != tuple(shape):
                raise CheckpointError(f"{key}: shape {list(shape)} does not fit the model dims {info} "
                                      "(the checkpoint is inconsistent)")
            file = f"rank_{ranks.rank(tp=tp_rank, cp=0, dp=0, pp=stage):05d}.safetensors"
            for i, pc in enumerate(smap.pieces):
                slab = f"{key}/{tp_rank}.{i}"
                plan[key].append((file, slab, pc.glob, pc.shape))
                files[file].append((slab, torch.float32, pc.shape))
    writers = {f: StreamingWriter(tmp / f, entries) for f, entries in files.items()}
    with Progress(len(shapes), "writing", "tensors", enabled=show_progress) as bar:
        for key in shapes:
            full = fetch(key).float()
            for file, slab, glob, shape in plan[key]:
                writers[file].write(slab, full[tuple(slice(a, a + n) for a, n in zip(glob, shape))].contiguous())
            del full
            bar.update()
    for w in writers.values():
        w.close()
    index = {"format": FORMAT, "step": carried.step,
             "layout": {"tp": tp, "pp": pp, "dp": None, "sp": None, "vpp": vpp},
             "model": info, "extra": carried.extra or {}, "files": {f: sha256(tmp / f) for f in files},
             "rng_files": {}, "rng_keys": [], "optimizer_step": carried.optimizer_step,
             "tensors": {key: {"shape": list(shapes[key]), "dtype": "float32",
                               "slabs": [{"file": f, "key": s, "offset": list(g), "shape": list(n)}
                                         for f, s, g, n in plan[key]]} for key in shapes}}
    _write_json(tmp / INDEX, index)
    if out.exists():
        raise CheckpointError(f"output {out} appeared while writing (another command?): left it untouched")
    publish(tmp, out)


def reshard(src: Path, out: Path, tp: int = 1, pp: int = 1, vpp: int = 1, pp_layers: list[int] | None = None,
            show_progress: bool = True) -> Path:
    """Rewrite checkpoint `src` laid out for (tp, pp, vpp); tp = pp = vpp = 1 is one file of full tensors.
    Extra state (step, sampler, scaler, config) is carried over; per-rank RNG states are not (a new layout
    re-seeds them, see `megalite.checkpoint.sharded`)."""
    index = read_index(src)
    reader = SlabReader(src, index)
    shapes = {k: tuple(v["shape"]) for k, v in index["tensors"].items()}
    try:
        return write_checkpoint(out, shapes, lambda k: reader.read_region(k, (0,) * len(shapes[k]), shapes[k]),
                                index["model"], Target(tp, pp, vpp, pp_layers),
                                Carried(index.get("extra"), index["step"], index.get("optimizer_step")), show_progress)
    finally:
        reader.close()
