"""The context-parallel ring: which global ranks form it, read from the ParallelState.

Rank order for a tp x cp x pp x dp world (Megatron-LM's order, tp fastest, then cp, then dp, then pp):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

cp sits next to tp, inside a node: every attention layer moves K/V (forward) and K/V plus dK/dV
(backward) between cp neighbours, a volume of the order of the layer's activations, like TP's; dp (one
gradient reduction per step) and pp (one p2p per micro-batch boundary) tolerate slower links. With cp = 1
this is the (tp, dp, pp) order, so adding the dimension moved no existing layout.

The attention functions take the ParallelState itself (its 'cp' process group and counter); `ContextGroup`
is the typed view of it they use to find their ring neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.parallel.state import GroupKind, ParallelState, coords_rank

GROUP: GroupKind = "cp"


def context_group_ranks(tp: int, cp: int, pp: int, dp: int) -> list[list[int]]:
    """Every cp ring of the layout (ranks that differ only in cp_rank), each in cp-rank (= ring) order."""
    return [[coords_rank(tp_rank, dp_rank, pp_rank, tp, dp, cp_rank, cp) for cp_rank in range(cp)]
            for pp_rank in range(pp) for dp_rank in range(dp) for tp_rank in range(tp)]


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its cp ring: `ranks` are global ranks in ring order, `ranks[cp_rank]` is us."""

    state: ParallelState
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, state: ParallelState) -> ContextGroup:
        c = state.coords
        return cls(state, tuple(coords_rank(c.tp, c.dp, c.pp, state.tp, state.dp, r, state.cp)
                                for r in range(state.cp)))

    @property
    def cp(self) -> int:
        return self.state.cp

    @property
    def cp_rank(self) -> int:
        return self.state.cp_rank

    @property
    def next_rank(self) -> int:
        """Global rank we send K/V to."""
        return self.ranks[(self.cp_rank + 1) % self.cp]

    @property
    def prev_rank(self) -> int:
        """Global rank we receive K/V from."""
        return self.ranks[(self.cp_rank - 1) % self.cp]
