"""`train.init_from`: the checkpoint whose weights a run starts from (a megalite checkpoint of any layout, or a
Hugging Face model directory, imported once into the cache the way tools/import_hf.py imports it).

Only the weights are taken: the run builds a fresh optimizer, starts the learning-rate schedule and the data
at their beginning and seeds its RNG streams from train.seed, as a new run would. The model's shape comes from
that checkpoint (`checkpoint.model_shape.apply_checkpoint_shape`), as for `checkpoint.load`, except what no weight
depends on: a longer `model.seq_len` (continued pretraining at a longer context, with the RoPE scaling the run
gives; a learned-position gpt2 keeps its own), `model.rope_theta` and the rope scaling. Modules the checkpoint
lacks (`mtp.num_layers` beyond its depth) start as a fresh run's, named in the run's one line (`init_note`),
as are the checkpoint's modules the run leaves out. A run that finds a checkpoint
of its own to resume (checkpoint.dir, checkpoint.load) resumes it instead: a restarted fine-tuning job
continues where it stopped rather than starting over from the base weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from megalite.checkpoint.sharded import INDEX, find
from megalite.data.demo import default_cache_dir
from megalite.errors import CheckpointError


def _hf_key(hf_dir: Path) -> str:
    """A name for the import of `hf_dir` that changes when its files do."""
    h = hashlib.sha256(str(hf_dir.resolve()).encode())
    for f in sorted(hf_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resolve_init_from(path: str, cache_dir: str = "", quiet: bool = True) -> Path:
    """The megalite checkpoint directory `path` names: itself (or its newest step), or the import of a Hugging
    Face model directory (config.json + safetensors) into `<cache>/init_from/`."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"train.init_from {path!r} does not exist: give a megalite checkpoint (a step_* "
                              "directory or a checkpoint root) or a Hugging Face model directory")
    if (p / INDEX).is_file() or (p / "latest").is_file():
        found = find(str(p), "")
        assert found is not None
        return found
    if not (p / "config.json").is_file():
        raise CheckpointError(f"train.init_from {path!r} is neither a megalite checkpoint (no {INDEX}) nor a Hugging "
                              "Face model directory (no config.json)")
    from megalite.checkpoint.interop.hf import import_hf
    from megalite.checkpoint.interop.hf_families import MAPPING

    out = Path(default_cache_dir(cache_dir)) / "init_from" / f"{p.name}-{_hf_key(p)}"
    if (out / INDEX).is_file():
        return out
    # Every rank of a launch may get here at once: each imports into its own directory, the first rename wins.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    import_hf(p, tmp, show_progress=not quiet, mapping=MAPPING)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / INDEX).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def init_note(source: str, fresh: list[str], left: list[str]) -> str:
    """The one line a run from `source`'s weights logs: what it took, the modules it initialised because the
    checkpoint has none (a multi-token prediction depth added), and the modules of the checkpoint it left out."""
    out = f"initialized the weights from {source} (train.init_from; fresh optimizer, schedule and data position)"
    if fresh:
        out += f"; new, initialised as a fresh run's: {', '.join(fresh)}"
    if left:
        out += f"; not taken (this run has no such module): {', '.join(left)}"
    return out
