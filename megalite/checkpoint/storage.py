"""Slab files: a streaming safetensors writer and a reader that assembles any region of a global tensor.

A checkpoint's `index.json` lists, for every logical tensor ("param/<name>", "exp_avg/<name>",
"exp_avg_sq/<name>"), its global shape and the slabs that cover it:

    {"shape": [67, 32], "dtype": "float32",
     "slabs": [{"file": "rank_00000.safetensors", "key": "param/embedding.weight/0",
                "offset": [0, 0], "shape": [36, 32]}, ...]}

The writer lays out the safetensors header from a plan *before* any data exists, then appends tensors
one at a time, so a converter holds one tensor in memory, not a whole file's worth (safetensors'
own `save_file` needs the complete dict). The reader opens a file lazily, checks its sha256 against
the index once, and copies out only the overlap of each slab with the requested region
(`safe_open(...).get_slice`), so a rank reads just the bytes of its own shard.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import IO, Any, Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from megalite.checkpoint.files import (LATEST, inside, open_no_link, refuse_link, saved_steps, sha256,
                                      step_of_dir_name)
from megalite.errors import CheckpointError, ConfigError, MegaliteError
from megalite.parallel.state import ParallelState

_ST_DTYPES = {torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64", torch.bfloat16: "BF16",
              torch.float16: "F16"}


class StreamingWriter:
    """Write a safetensors file whose entries (key, dtype, shape) are known up front, tensor by tensor."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "megalite"}}
        offset = 0
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for key, dtype, shape in entries:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((key, dtype, tuple(shape)))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
        self.path = path
        self._f = open_no_link(path, "wb", exclusive=True)  # a fresh file in megalite's own step_N.tmp
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, dtype, shape = self._order[self._next]
        if key != want_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{self.path}: wrote {key} {tensor.dtype} {tuple(tensor.shape)}, "
                               f"planned {want_key} {dtype} {shape}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._f.write(flat.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        """Check every planned tensor arrived, then flush and fsync (the data is durable on return)."""
        if self._next != len(self._order):
            self._f.close()
            raise RuntimeError(f"{self.path}: {len(self._order) - self._next} planned tensors never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def overlap(a_start: tuple[int, ...], a_shape: tuple[int, ...], b_start: tuple[int, ...],
            b_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection (start, shape) of two boxes in global coordinates, or None if empty."""
    lo = tuple(max(a, b) for a, b in zip(a_start, b_start))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_start, a_shape, b_start, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


class SlabReader:
    """Reads regions of the logical tensors of one checkpoint directory; verifies each file it opens."""

    def __init__(self, root: Path, index: dict[str, Any], verify: bool = True) -> None:
        self.root, self.index, self.verify = Path(root), index, verify
        self._handles: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = inside(self.root, file, "index.json")
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                                      "load an earlier one or re-run the save")
            expected = self.index["files"].get(file)
            if self.verify and expected is None:
                raise CheckpointError(f"checkpoint file {path} has no sha256 in index.json, so it cannot be "
                                      "verified: the index was edited or is incomplete; load an earlier checkpoint")
            if self.verify and sha256(path) != expected:
                raise CheckpointError(f"checkpoint file {path} is corrupt (sha256 mismatch with index.json): "
                                      "restore it from a copy or load an earlier checkpoint")
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"checkpoint file {path} cannot be read ({e}): restore it from a copy "
                                      "or load an earlier checkpoint") from e
        return self._handles[file]

    def has(self, key: str) -> bool:
        return key in self.index["tensors"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.index["tensors"][key]["shape"])

    def read_region(self, key: str, start: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region [start, start+shape) of logical tensor `key`, assembled from its slabs (fp32)."""
        entry = self.index["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"the checkpoint has no tensor {key!r}: it was saved from a different model "
                                  "(check model.* matches the checkpointed run)")
        out = torch.empty(shape, dtype=torch.float32)  # read_index accepts only float32 entries
        filled = 0
        for slab in entry["slabs"]:
            hit = overlap(tuple(slab["offset"]), tuple(slab["shape"]), start, shape)
            if hit is None:
                continue
            lo, size = hit
            src = tuple(slice(l - o, l - o + s) for l, o, s in zip(lo, slab["offset"], size))
            dst = tuple(slice(l - o, l - o + s) for l, o, s in zip(lo, start, size))
            try:
                stored = self._handle(slab["file"]).get_slice(slab["key"])
                found = (stored.get_dtype(), list(stored.get_shape()))
                if found != ("F32", list(slab["shape"])):  # the header contradicts index.json: never reinterpret
                    raise CheckpointError(f"checkpoint file {self.root / slab['file']}: {slab['key']} is "
                                          f"{found[0]} {found[1]} but index.json says F32 {slab['shape']}: the "
                                          "file or the index was edited; load an earlier checkpoint")
                piece = stored[src] if src else self._handle(slab["file"]).get_tensor(slab["key"])
            except SafetensorError as e:
                raise CheckpointError(f"checkpoint file {self.root / slab['file']} has no readable "
                                      f"{slab['key']} ({e}): the file is damaged; load an earlier checkpoint") from e
            out[dst] = piece.reshape(size)
            filled += math.prod(size)
        if filled != math.prod(shape):
            raise CheckpointError(f"checkpoint {self.root}: the slabs of {key} cover {filled} of the "
                                  f"{math.prod(shape)} elements requested; index.json is inconsistent")
        return out

    def read_file_tensor(self, file: str, key: str, dtype: str = "U8") -> torch.Tensor:
        """A whole stored tensor (the RNG states: bytes), which must exist with `dtype`."""
        try:
            stored = self._handle(file).get_slice(key)
            if stored.get_dtype() != dtype:
                raise CheckpointError(f"checkpoint file {self.root / file}: {key} is {stored.get_dtype()}, "
                                      f"expected {dtype}: the file was edited; load an earlier checkpoint")
            return self._handle(file).get_tensor(key)
        except SafetensorError as e:
            raise CheckpointError(f"checkpoint file {self.root / file} has no readable {key} (named by index.json's "
                                  f"rng_keys; {e}): the index was edited; load an earlier checkpoint") from e

    def close(self) -> None:
        self._handles.clear()


# ----------------------------------------------------------------------------- owning a checkpoint directory

LOCK_FILE = ".megalite.lock"


class DirectoryClaim:
    """Held for the run's lifetime: the open, `flock`ed lock file. The kernel releases the lock when the
    process ends, however it ends (a crash or SIGKILL never leaves the directory stuck)."""

    def __init__(self, handle: IO[str] | None) -> None:
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def newest_step(directory: Path) -> int:
    """The newest complete step saved in `directory` (its `latest` or a step_* with an index.json); -1 if none."""
    steps = list(saved_steps(directory))
    pointer = directory / LATEST
    if pointer.is_file():
        step = step_of_dir_name(pointer.read_text(errors="replace").strip())
        steps += [step] if step is not None else []
    return max(steps, default=-1)


def _lock(directory: Path, what: str = "checkpoint.dir",
          error: type[MegaliteError] = CheckpointError) -> IO[str]:
    handle = open_no_link(directory / LOCK_FILE, "a+", error)  # a link there is refused, never rewritten
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown owner"
        handle.close()
        raise error(f"{what} {directory} is in use by another run ({owner}): two runs would interleave their "
                    f"files; wait for it to end or choose another {what}")
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
    handle.flush()
    return handle


def _refuse_planted_links(directory: Path) -> None:
    """Every name a run writes, renames over or prunes in its checkpoint directory (`latest`, its temporary
    name, `step_N`, `step_N.tmp`) must not be a link: refused here, before step 1 and on every rank (the
    writers check again), so a directory from someone else cannot redirect a save to a file elsewhere."""
    for entry in directory.iterdir():
        name = entry.name
        ours = name in (LATEST, LOCK_FILE) or name.startswith(f".{LATEST}.tmp-") \
            or step_of_dir_name(name.removesuffix(".tmp")) is not None
        if ours:
            refuse_link(entry, hard_links=False)


def _probe_writable(directory: Path) -> None:
    probe = directory / f".megalite.write-test-{os.getpid()}"
    if os.path.lexists(probe):
        probe.unlink()  # a stale one of this pid (or a link planted there: removed, not followed)
    try:
        with open_no_link(probe, "wb", exclusive=True) as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.lexists(probe):
            probe.unlink()


def _claim_on_rank0(directory: Path, start_step: int, resume_from: Path | None) -> DirectoryClaim:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = _lock(directory)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir {directory} cannot be created or written ({e.strerror or e}): "
                              "choose a writable directory") from e
    claim = DirectoryClaim(handle)
    try:
        _refuse_planted_links(directory)
        _probe_writable(directory)
        newest = newest_step(directory)
        rewind_asked = resume_from is not None and resume_from.resolve().parent == directory.resolve()
        if newest > start_step and not rewind_asked:
            raise CheckpointError(
                f"checkpoint.dir {directory} already holds step {newest} but this run starts at step {start_step}: "
                f"it would overwrite that run's checkpoints and move `latest` back; resume it (checkpoint.load "
                f"latest), choose another checkpoint.dir, or load an earlier step of it explicitly "
                f"(checkpoint.load {directory}/step_...) to go back on purpose")
    except OSError as e:
        claim.release()
        raise CheckpointError(f"checkpoint.dir {directory} is not writable ({e.strerror or e}): fix its permissions "
                              "or free disk space before training, or choose another directory") from e
    except BaseException:
        claim.release()
        raise
    return claim


def claim_directory(directory: str, start_step: int, resume_from: Path | None,
                    state: ParallelState) -> DirectoryClaim:
    """Make `directory` this run's checkpoint directory before step 1, or raise CheckpointError: it must be
    writable (probed with a real write), not in use by another run (an exclusive lock held until this
    process ends), and never silently rewound (a run starting at an earlier step than the directory
    holds is refused unless it loaded that earlier step from this same directory). Every rank calls it;
    rank 0 checks and the verdict is shared, so no rank trains while another has refused."""
    if not directory:
        return DirectoryClaim(None)
    return _rank0_verdict(state, lambda: _claim_on_rank0(Path(directory), start_step, resume_from), CheckpointError,
                          f"rank 0 refused checkpoint.dir {directory} (its message says why)")


def claim_log_directory(log_dir: str, checkpoint_dir: str, state: ParallelState) -> DirectoryClaim:
    """Lock `logging.dir` for this run (rank 0 writes there; the verdict is shared), so that a second run
    with the same logging.dir is refused (ConfigError) before it rotates or rewrites the live run's
    metrics.jsonl and config.toml. Nothing to do when it is the checkpoint directory (already locked)."""
    if not log_dir or (checkpoint_dir and Path(log_dir).resolve() == Path(checkpoint_dir).resolve()):
        return DirectoryClaim(None)

    def attempt() -> DirectoryClaim:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        return DirectoryClaim(_lock(Path(log_dir), "logging.dir", ConfigError))

    return _rank0_verdict(state, attempt, ConfigError, f"rank 0 refused logging.dir {log_dir} (its message says why)")


def _rank0_verdict(state: ParallelState, attempt: Callable[[], DirectoryClaim], error: type[MegaliteError],
                   fallback: str) -> DirectoryClaim:
    """Run `attempt` on rank 0 and share whether it refused (an `error`), so every rank stops together."""
    claim, problem = DirectoryClaim(None), ""
    if state.rank == 0:
        try:
            claim = attempt()
        except error as e:
            if state.world_size == 1:
                raise
            problem = str(e)
    if state.world_size > 1:
        flag = torch.tensor([float(bool(problem))], device=state.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise error(problem or fallback)
    return claim
