"""Config validation, where the run executes: kernels, backend and device against this machine, torch.compile's
needs, the output directories and the data blend. One phrase per problem; `validate.py` collects them.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from megalite.config.schema import Config


def environment_problems(cfg: Config, device_type: str) -> list[str]:
    """Kernels, backend and device against where the run executes; files and blending."""
    out: list[str] = []
    if cfg.model.kernels == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        out.append("model.kernels=triton on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                   "or use model.kernels=torch")
    if cfg.parallel.backend == "nccl" and device_type != "cuda":
        out.append(f"parallel.backend=nccl needs CUDA but the run is on {device_type}: use backend=gloo or auto")
    if cfg.train.device == "cuda" and device_type != "cuda":
        out.append(f"train.device=cuda but the run is on {device_type}: use train.device=cpu or auto")
    if cfg.checkpoint.interval > 0 and not cfg.checkpoint.dir:
        out.append(f"checkpoint.interval={cfg.checkpoint.interval} needs checkpoint.dir: set a directory "
                   f"or interval=0")
    if cfg.checkpoint.load == "latest" and not cfg.checkpoint.dir:
        out.append("checkpoint.load=latest needs checkpoint.dir to search: set it or give a checkpoint directory")
    d = cfg.data
    if d.weights and len(d.weights) != len(d.path):
        out.append(f"data.weights has {len(d.weights)} entries but data.path has {len(d.path)}: "
                   f"give one weight per path or none")
    if d.weights and (min(d.weights) < 0 or sum(d.weights) <= 0):
        out.append(f"data.weights {d.weights} must be >= 0 with a positive sum")
    return out


_STEP_DIR = re.compile(r"step_\d{8}(\.tmp)?")


def _is_saved_checkpoint(path: Path) -> bool:
    """A step directory by name, or any directory holding a megalite index next to its rank files."""
    if _STEP_DIR.fullmatch(path.name):
        return True
    return (path / "index.json").is_file() and next(path.glob("rank_*.safetensors"), None) is not None


def path_problems(cfg: Config) -> list[str]:
    """Directories that exist as files, outputs under a file, and a checkpoint.dir inside a step directory."""
    out: list[str] = []
    # checkpoint.dir is checked (exit code 4, with a real write) by megalite.checkpoint.storage.claim_directory
    dirs = {"logging.dir": cfg.logging.dir, "data.cache_dir": cfg.data.cache_dir}
    for key, value in dirs.items():
        if not value:
            continue
        path = Path(value).expanduser()
        blocker = next((q for q in [path, *path.parents] if q.exists() and not q.is_dir()), None)
        if blocker == path:
            out.append(f"{key} {value} is an existing file, not a directory: choose a directory path")
        elif blocker is not None:
            out.append(f"{key} {value} lies under {blocker}, which is a file: choose a directory path")
    ckpt = cfg.checkpoint.dir
    if ckpt:
        path = Path(ckpt).expanduser().absolute()
        inner = next((q for q in [path, *path.parents] if _is_saved_checkpoint(q)), None)
        if inner is not None:
            out.append(f"checkpoint.dir {ckpt} is inside the saved checkpoint {inner}: set checkpoint.dir to the "
                       f"directory that holds the step_* directories ({inner.parent}), and use checkpoint.load "
                       "to pick a step")
    return out


def compile_problems(cfg: Config, device_type: str) -> list[str]:
    """model.compile (megalite/model/compile.py): the backend, what it needs here, the schedules it refuses."""
    from megalite.model.compile import BACKENDS
    from megalite.pipeline.schedules import ZERO_BUBBLE

    m = cfg.model
    if m.compile_backend not in BACKENDS:
        return [f"model.compile_backend={m.compile_backend!r}: use one of {', '.join(BACKENDS)}"]
    if not m.compile:
        return []
    out: list[str] = []
    if cfg.parallel.schedule in ZERO_BUBBLE:
        # Compiled blocks compute each linear's weight gradient inside the graph's backward (the gradient sync's
        # fold, which would defer it to W, cannot be traced): a split backward would have no W left to move.
        out.append(f"model.compile with parallel.schedule={cfg.parallel.schedule}: the compiled blocks compute "
                   "their weight gradients in B, so there is nothing to defer to W: use 1f1b or interleaved")
    if m.compile_backend == "inductor" and device_type == "cpu":
        from megalite.model.compile import cpu_compiler  # torch: late, megalite.config stays light

        found, searched = cpu_compiler()
        if found is None:
            out.append(f"model.compile with inductor on CPU needs a C++ compiler and none of {searched} is an "
                       "executable (on PATH, or the path in CXX): install one (apt-get install g++), point CXX at "
                       "it, or set model.compile_backend=aot_eager")
    return out
