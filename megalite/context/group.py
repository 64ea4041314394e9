"""The context-parallel ring: which global ranks form it, read from the ParallelState.

The rank order (tp fastest, then cp, dp, pp) and why cp sits next to tp are in megalite/parallel/state.py;
a ring is the state's 'cp' group, in cp-rank order. The attention functions take the ParallelState itself
(its 'cp' process group and counter); `ContextGroup` is the typed view of it they use to find their ring
neighbours. Hybrid cp (`hybrid.py`) runs its ring over a subset of the cp ranks (`ContextGroup.ring_of`): the
same communicator, a shorter ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.parallel.state import GroupKind, ParallelState

GROUP: GroupKind = "cp"


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its cp ring: `ranks` are global ranks in ring order, `ranks[cp_rank]` is us."""

    state: ParallelState
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, state: ParallelState) -> ContextGroup:
        return cls(state, tuple(state.ranks(GROUP)))  # a sub-grid's ranks in index (= cp_rank) order

    @classmethod
    def ring_of(cls, state: ParallelState, a2a: int) -> ContextGroup:
        """Hybrid cp's ring: the cp ranks whose cp_rank is ours mod `a2a` (one per all-to-all group), in order."""
        return cls(state, tuple(state.ranks(GROUP)[state.cp_rank % a2a::a2a]))

    @property
    def cp(self) -> int:
        """Ranks in this ring (the cp size, or cp / a2a in hybrid cp)."""
        return len(self.ranks)

    @property
    def cp_rank(self) -> int:
        """Our index in the ring."""
        return self.ranks.index(self.state.rank)

    @property
    def next_rank(self) -> int:
        """Global rank we send K/V to."""
        return self.ranks[(self.cp_rank + 1) % self.cp]

    @property
    def prev_rank(self) -> int:
        """Global rank we receive K/V from."""
        return self.ranks[(self.cp_rank - 1) % self.cp]
