"""The type-checked reading of a DCP `.metadata`: every field megalite's readers (and torch's FileSystemReader
under them) index, iterate or join to a path is of the type torch writes, checked once after unpickling, so a
crafted or damaged file is one CheckpointError line naming the field, never an AttributeError or TypeError deep
in a reader (a `storage_data` that is a list, a `state_dict_metadata` of None, a chunk's offsets as a string).

The unpickler (megalite/checkpoint/interop/dcp.py) already limits which classes the file can name; this checks
how they are put together: `Metadata.state_dict_metadata` a dict of names to tensor or bytes entries, a tensor
entry's dtype, size and chunks (inside the size), `storage_data` a dict of `MetadataIndex` to `_StorageInfo` (a
relative file name, a non-negative offset and length), `planner_data` a dict or absent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)


def _ints(x: Any, n: int | None = None) -> bool:
    """A tuple (torch.Size) or list of non-negative ints, of length `n` when given."""
    return (isinstance(x, (tuple, list)) and (n is None or len(x) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x))


def _tensor_problem(name: str, entry: TensorStorageMetadata) -> str | None:
    props = getattr(entry, "properties", None)
    if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"state_dict_metadata[{name!r}] has no tensor properties with a dtype"
    size: Any = getattr(entry, "size", None)
    if not _ints(size):
        return f"state_dict_metadata[{name!r}].size is {size!r}, not a list of sizes"
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        return f"state_dict_metadata[{name!r}].chunks is a {type(chunks).__name__}, not a list"
    for chunk in chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _ints(chunk.offsets, len(size))
                and _ints(chunk.sizes, len(size))
                and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, size))):
            return f"state_dict_metadata[{name!r}] has a chunk {chunk!r} that is not inside its size {list(size)}"
    return None


def _storage_problem(index: Any, info: Any) -> str | None:
    if not (isinstance(index, MetadataIndex) and isinstance(getattr(index, "fqn", None), str)):
        return f"storage_data has a key {index!r}, not a MetadataIndex naming a tensor"
    if not (isinstance(info, _StorageInfo) and isinstance(getattr(info, "relative_path", None), str)
            and _ints([getattr(info, "offset", None), getattr(info, "length", None)])):
        return f"storage_data[{index.fqn!r}] is {info!r}, not a file name with an offset and a length"
    return None


def metadata_problems(md: Metadata) -> list[str]:
    """What makes an unpickled `Metadata` unusable, one phrase each (empty: every field of the expected type)."""
    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return [f"state_dict_metadata is {type(entries).__name__}, not a dict of the stored entries"]
    out: list[str] = []
    for name, entry in entries.items():
        if not isinstance(name, str):
            out.append(f"state_dict_metadata has a key {name!r}, not a name")
        elif isinstance(entry, TensorStorageMetadata):
            problem = _tensor_problem(name, entry)
            out += [problem] if problem else []
        elif not isinstance(entry, BytesStorageMetadata):
            out.append(f"state_dict_metadata[{name!r}] is a {type(entry).__name__}, not a tensor or bytes entry")
        if out:
            return out
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        return [f"storage_data is {type(storage).__name__}, not a dict of where each entry is stored"]
    for index, info in storage.items():
        problem = _storage_problem(index, info)
        if problem:
            return [problem]
    planner = getattr(md, "planner_data", None)
    if planner is not None and not isinstance(planner, dict):
        out.append(f"planner_data is {type(planner).__name__}, not a dict")
    return out
