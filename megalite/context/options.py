"""How a context-parallel run computes attention across its cp ranks: the typed choice the model is built with.

    ring       ring attention (`ring.py`): K/V blocks passed around the cp ranks, overlapped with compute;
               only this rank's K/V are held. The default.
    allgather  all-gather the K/V, reduce-scatter dK/dV (`allgather.py`; the form Llama 3 used): fewer
               bytes than the ring, the full-sequence K/V held on every rank, transfers not overlapped.
    a2a        all-to-all between sequence-sharded and head-sharded layouts (`ulysses.py`; DeepSpeed-Ulysses,
               Jacobs et al. 2023): each rank attends over the whole sequence for heads/cp of its heads;
               needs the heads and the kv heads (after tp) divisible by cp.

docs/parallelism.md says when to pick which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

from megalite.errors import ConfigError

CpMode = Literal["ring", "allgather", "a2a"]
CP_MODES: tuple[str, ...] = get_args(CpMode)


@dataclass(frozen=True)
class ContextOptions:
    """`parallel.cp_mode` and `data.document_mask` as the model sees them (ignored at cp = 1 but the mask)."""

    mode: CpMode = "ring"
    document_eod: int | None = None  # data.document_mask: the EOD token that ends each document; None = off

    @classmethod
    def of(cls, mode: str, document_eod: int | None = None) -> ContextOptions:
        """From the config's strings (validated there first; a ConfigError here for direct callers)."""
        if mode not in CP_MODES:
            raise ConfigError(f"parallel.cp_mode {mode!r}: choose one of {', '.join(CP_MODES)}")
        return cls(mode=cast(CpMode, mode), document_eod=document_eod)
