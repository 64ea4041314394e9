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

from typing import Any

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


def check_resume(saved: dict[str, Any], seq_len: int, seed: int, sources: list[dict[str, Any]]) -> int:
    """The saved stream count, after checking that the saved position means the same data; else a DataError."""
    if saved.get("format") != FORMAT:
        raise DataError(f"the checkpoint's data position has format {saved.get('format')!r}, this megalite reads "
                        f"{FORMAT!r}")
    fix = "resume with the checkpointed run's data.path, model.seq_len and train.seed, or start the data afresh " \
          "(--train.init_from CKPT keeps the weights only)"
    if int(saved["seq_len"]) != seq_len:
        raise DataError(f"the checkpoint's data was packed into samples of model.seq_len {saved['seq_len']}, this run "
                        f"has {seq_len}: {fix}")
    if int(saved["seed"]) != seed:
        raise DataError(f"the checkpoint's data order used train.seed {saved['seed']}, this run uses {seed}: {fix}")
    theirs = saved.get("sources", [])
    if len(theirs) != len(sources) or any(a != b for a, b in zip(theirs, sources)):
        diff = next((f"{a} -> {b}" for a, b in zip(theirs, sources) if a != b),
                    f"{len(theirs)} -> {len(sources)} sources")
        raise DataError(f"the checkpoint's data sources differ from this run's ({diff}): the saved positions would "
                        f"point into other records; {fix}")
    streams = int(saved["streams"])
    if len(saved.get("states", [])) != streams:
        raise DataError(f"the checkpoint's data position holds {len(saved.get('states', []))} stream states for "
                        f"{streams} streams: it is corrupt")
    return streams
