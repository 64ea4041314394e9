"""The streamed data's position in a checkpoint: every stream's state, in a form no layout enters.

Step s of a run takes `G / V` samples from each of the V streams (G = train.global_batch_size); the step's
samples, in their canonical order, are stream 0's, then stream 1's, ..., and data-parallel rank r reads
the contiguous block of streams `[r V/dp, (r+1) V/dp)`, which is the slice `[r G/dp, (r+1) G/dp)` of that
order: the same rule as the `.bin`/`.idx` sampler, so the *set* of samples in a step, and so the gradient,
is the same at any dp. A checkpoint saves all V stream states (gathered over dp), the stream count, the
sample length, the seed and each source's fingerprint; a run resumed at another dp (any that divides V)
reads the same streams from the same positions, token for token.
"""

from __future__ import annotations

import os
from typing import Any

from megalite.data.readers import content_digest
from megalite.errors import ConfigError, DataError

FORMAT = "megalite-stream-1"


def check_streams(streams: int, dp: int, global_batch_size: int) -> None:
    """dp must divide the stream count, and the stream count the global batch (one block of streams a rank)."""
    if streams < 1:
        raise ConfigError(f"data.streams = {streams}: must be >= 1 (0 = the data-parallel size)")
    if streams % dp:
        raise ConfigError(f"data.streams = {streams} is not a multiple of dp = {dp}: each data-parallel rank reads "
                          "a whole number of streams; set data.streams to a multiple of every dp you will run at "
                          "(it is fixed for the run's whole life: a resumed run keeps the checkpoint's)")
    if global_batch_size % streams:
        raise ConfigError(f"train.global_batch_size = {global_batch_size} is not a multiple of data.streams = "
                          f"{streams}: each step takes the same number of samples from every stream")


def owned_streams(streams: int, dp: int, dp_rank: int) -> range:
    per = streams // dp
    return range(dp_rank * per, (dp_rank + 1) * per)


def position(streams: int, seq_len: int, seed: int, sources: list[dict[str, Any]], states: list[dict[str, Any]],
             steps: int) -> dict[str, Any]:
    return {"format": FORMAT, "streams": streams, "seq_len": seq_len, "seed": seed, "sources": sources,
            "states": states, "steps": steps}


def token_file_fingerprint(prefix: str) -> dict[str, Any]:
    """A `.bin`/`.idx` pair's fingerprint: its content digest (megalite/data/readers.py `content_digest`)."""
    files = [prefix + ".idx", prefix + ".bin"]
    return {"path": prefix, "kind": "bin", "names": [os.path.basename(prefix)],
            "sizes": [sum(os.path.getsize(f) for f in files)], "content": [content_digest(files)]}


def source_change(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's fingerprint of a source and this run's, naming the file; None: the
    same data. A fingerprint saved before content digests existed is compared without them."""
    where = repr(now.get("path"))
    for key in ("path", "kind", "files"):
        if saved.get(key) != now.get(key):
            return f"{where}: {key} {saved.get(key)!r} -> {now.get(key)!r}"
    names = now.get("names") or [f"file {i}" for i in range(len(now.get("sizes", [])))]
    if "names" in saved and saved["names"] != now.get("names"):
        i = next(i for i, (a, b) in enumerate(zip(saved["names"], names)) if a != b)
        return f"{where}: file {saved['names'][i]!r} -> {names[i]!r}"
    for i, (a, b) in enumerate(zip(saved.get("sizes", []), now.get("sizes", []))):
        if a != b:
            return f"{where}: {names[i]!r} was {a} {'rows' if now.get('kind') == 'hf' else 'bytes'}, is {b}"
    if "content" in saved and "content" in now:
        for i, (a, b) in enumerate(zip(saved["content"], now["content"])):
            if a != b:
                return f"{where}: {names[i]!r} was rewritten since the checkpoint (same size, other content)"
    rest = {k for k in set(saved) | set(now) if k not in ("path", "kind", "files", "names", "sizes", "content")}
    for key in sorted(rest):  # a .bin/.idx source: its documents and tokens
        if saved.get(key) != now.get(key):
            return f"{where}: {key} {saved.get(key)!r} -> {now.get(key)!r}"
    return None


FIX = ("resume with the checkpointed run's data.path, model.seq_len and train.seed; or pass --data.on_change restart "
       "to read this data from its start (weights, optimizer and step are resumed); or start afresh with "
       "--train.init_from CKPT (the weights only)")


def resume_mismatch(saved: dict[str, Any], seq_len: int, seed: int, sources: list[dict[str, Any]]) -> str | None:
    """Why the checkpoint's data position does not mean this run's data (one phrase), or None when it does."""
    if int(saved["seq_len"]) != seq_len:
        return (f"the checkpoint's data was packed into samples of model.seq_len {saved['seq_len']}, this run has "
                f"{seq_len}")
    if int(saved["seed"]) != seed:
        return f"the checkpoint's data order used train.seed {saved['seed']}, this run uses {seed}"
    theirs = saved.get("sources", [])
    if len(theirs) != len(sources):
        return f"the checkpoint read {len(theirs)} data sources, this run has {len(sources)}"
    for a, b in zip(theirs, sources):
        change = source_change(a, b)
        if change is not None:
            return f"the data changed since the checkpoint ({change}): its saved positions would point at other records"
    return None


def check_resume(saved: dict[str, Any], seq_len: int, seed: int, sources: list[dict[str, Any]],
                 restart: bool = False) -> tuple[int | None, str | None]:
    """(the saved stream count, None) after checking that the saved position means the same data; else a
    DataError, or with `restart` (data.on_change restart) (None, why) and the data is read from its start."""
    if saved.get("format") != FORMAT:
        raise DataError(f"the checkpoint's data position has format {saved.get('format')!r}, this megalite reads "
                        f"{FORMAT!r}")
    why = resume_mismatch(saved, seq_len, seed, sources)
    if why is not None:
        if restart:
            return None, why
        raise DataError(f"{why}: {FIX}")
    streams = int(saved["streams"])
    if len(saved.get("states", [])) != streams:
        raise DataError(f"the checkpoint's data position holds {len(saved.get('states', []))} stream states for "
                        f"{streams} streams: it is corrupt")
    return streams, None
