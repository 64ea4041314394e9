"""The context-parallel ring: which global ranks form it, and the handle the attention functions take.

Rank order for a tp x cp x pp x dp world (Megatron-LM's order, tp fastest, then cp, then dp, then pp):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

cp sits next to tp, inside a node: every attention layer moves K/V (forward) and K/V plus dK/dV
(backward) between cp neighbours, a volume of the order of the layer's activations, like TP's; dp (one
gradient reduction per step) and pp (one p2p per micro-batch boundary) tolerate slower links. With cp = 1
this is exactly today's `rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank` (megalite/parallel/state.py),
so adding the dimension there changes no existing layout.

Until ParallelState carries cp, `ContextGroup` is the handle: it answers `size('cp')`, `group('cp')`
and `counter` like ParallelState does, so megalite.parallel.comm's counted collectives take it as
their `state` and file the bytes under 'cp'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from megalite.parallel.counter import CommCounter

GROUP = "cp"


def context_group_ranks(tp: int, cp: int, pp: int, dp: int) -> list[list[int]]:
    """Every cp ring of the layout (ranks that differ only in cp_rank), each in cp-rank (= ring) order."""
    return [[((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank for cp_rank in range(cp)]
            for pp_rank in range(pp) for dp_rank in range(dp) for tp_rank in range(tp)]


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its cp ring. `ranks` are global ranks in ring order; `ranks[cp_rank]` is us."""

    cp: int = 1
    cp_rank: int = 0
    ranks: tuple[int, ...] = (0,)
    process_group: object | None = None
    counter: CommCounter = field(default_factory=CommCounter)

    def __post_init__(self) -> None:
        if len(self.ranks) != self.cp or not 0 <= self.cp_rank < self.cp:
            raise ValueError(f"ContextGroup: {len(self.ranks)} ranks for cp={self.cp}, cp_rank={self.cp_rank}")

    @property
    def next_rank(self) -> int:
        """Global rank we send K/V to."""
        return self.ranks[(self.cp_rank + 1) % self.cp]

    @property
    def prev_rank(self) -> int:
        """Global rank we receive K/V from."""
        return self.ranks[(self.cp_rank - 1) % self.cp]

    def size(self, kind: str) -> int:
        return self.cp if kind == GROUP else _unknown(kind)

    def group(self, kind: str) -> object | None:
        return self.process_group if kind == GROUP else _unknown(kind)


def _unknown(kind: str):  # noqa: ANN202 - never returns
    raise ValueError(f"ContextGroup knows only the group {GROUP!r}, not {kind!r}")


def new_context_group(tp: int, cp: int, pp: int, dp: int, counter: CommCounter | None = None) -> ContextGroup:
    """Create every cp ring of the layout (collectively: every rank calls `new_group` for every ring, in
    the same order, torch.distributed's contract) and return this rank's. Needs the default group when
    cp > 1; a cp = 1 ring needs no process group."""
    counter = counter or CommCounter()
    if cp == 1:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return ContextGroup(1, 0, (rank,), None, counter)
    if dist.get_world_size() != tp * cp * pp * dp:
        raise ValueError(f"world size {dist.get_world_size()} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp}")
    rank, mine = dist.get_rank(), None
    for ranks in context_group_ranks(tp, cp, pp, dp):
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = ContextGroup(cp, ranks.index(rank), tuple(ranks), pg, counter)
    assert mine is not None  # every rank is in exactly one ring
    return mine
