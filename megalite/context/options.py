"""How a context-parallel run computes attention across its cp ranks: the typed choice the model is built with.

    ring       ring attention (`ring.py`): K/V blocks passed around the cp ranks, overlapped with compute;
               only this rank's K/V are held. The default.
    allgather  all-gather the K/V, reduce-scatter dK/dV (`allgather.py`; the form Llama 3 used): fewer
               bytes than the ring, the full-sequence K/V held on every rank, transfers not overlapped.
    a2a        all-to-all between sequence-sharded and head-sharded layouts (`a2a.py`; DeepSpeed-Ulysses,
               Jacobs et al. 2023): each rank attends over the whole sequence for heads/cp of its heads;
               needs the heads and the kv heads (after tp) divisible by cp.
    hybrid     all-to-all inside groups of `parallel.cp_a2a` cp ranks, the ring across the groups (`hybrid.py`;
               Megatron's a2a+p2p, USP): the heads need only split by the a2a degree.

docs/parallelism.md says when to pick which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

from megalite.errors import ConfigError

CpMode = Literal["ring", "allgather", "a2a", "hybrid"]
CP_MODES: tuple[str, ...] = get_args(CpMode)


@dataclass(frozen=True)
class ContextOptions:
    """`parallel.cp_mode` and `data.document_mask` as the model sees them (ignored at cp = 1 but the mask)."""

    mode: CpMode = "ring"
    document_eod: int | None = None  # data.document_mask: the EOD token that ends each document; None = off
    a2a_degree: int = 1  # hybrid: cp ranks per all-to-all group (parallel.cp_a2a); the ring is cp / a2a_degree long

    @classmethod
    def of(cls, mode: str, document_eod: int | None = None, a2a_degree: int = 1) -> ContextOptions:
        """From the config's strings (validated there first; a ConfigError here for direct callers)."""
        if mode not in CP_MODES:
            raise ConfigError(f"parallel.cp_mode {mode!r}: choose one of {', '.join(CP_MODES)}")
        if a2a_degree < 1:
            raise ConfigError(f"parallel.cp_a2a = {a2a_degree}: must be >= 1")
        return cls(mode=cast(CpMode, mode), document_eod=document_eod, a2a_degree=a2a_degree)
