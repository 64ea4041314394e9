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

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megalite.checkpoint.files import inside, open_no_link, sha256
from megalite.errors import CheckpointError

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
