"""The rank grid: global ranks as digits of a mixed-radix number, one named digit per parallel dimension.

A layout's world is the product of its dimensions' sizes; a rank is the number whose digits (fastest first)
are its coordinates. megalite's order, tp fastest, then cp, dp, pp (Megatron's), and why, is in
megalite/parallel/state.py, which declares it; this file knows no dimension by name.

A process group is a sub-grid: the ranks that agree on every coordinate except the named ones. Naming
dimensions is all a group kind needs, so adding a dimension is one entry in `dims`.

A second factorisation of some consecutive dimensions (`refactor`) gives the same ranks other coordinates:
expert parallelism splits the dp x cp ranks into (ep, edp) digits of the same number, so the ep and edp
groups are sub-grids too, and no rank moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

Factorisation = tuple[tuple[str, int], ...]  # (dimension, size) pairs in rank order, fastest first


@dataclass(frozen=True)
class RankGrid:
    """A world of `prod(sizes)` ranks and every factorisation of it into named digits.

    `factorisations[0]` is the layout's own (tp, cp, dp, pp); each later one replaces a run of consecutive
    dimensions of it with others of the same product (`refactor`). Every dimension name is unique.
    """

    factorisations: tuple[Factorisation, ...]

    @classmethod
    def of(cls, *dims: tuple[str, int]) -> RankGrid:
        """The grid with these (name, size) dimensions, fastest first."""
        if any(size < 1 for _, size in dims):
            raise ValueError(f"every dimension size must be >= 1: {dims}")
        if len({name for name, _ in dims}) != len(dims):
            raise ValueError(f"dimension names repeat: {dims}")
        return cls((tuple(dims),))

    def refactor(self, old: tuple[str, ...], new: tuple[tuple[str, int], ...]) -> RankGrid:
        """This grid plus a factorisation in which the consecutive dimensions `old` are replaced by `new`
        (fastest first, same product): the same ranks, read with other digits."""
        base = self.factorisations[0]
        names = [n for n, _ in base]
        start = names.index(old[0]) if old and old[0] in names else -1
        if start < 0 or tuple(names[start:start + len(old)]) != old:
            raise ValueError(f"{old} are not consecutive dimensions of {names}")
        if prod(s for _, s in new) != self.size(*old) or any(s < 1 for _, s in new):
            raise ValueError(f"{new} does not factor {old} (size {self.size(*old)})")
        if {n for n, _ in new} & set(self.dims):
            raise ValueError(f"{new} reuses a dimension name of {self.dims}")
        return RankGrid(self.factorisations + (base[:start] + tuple(new) + base[start + len(old):],))

    @property
    def dims(self) -> tuple[str, ...]:
        """Every dimension name, the layout's own first (in rank order), then the refactored ones."""
        seen: dict[str, None] = {}
        for f in self.factorisations:
            seen.update((n, None) for n, _ in f)
        return tuple(seen)

    @property
    def world(self) -> int:
        return prod(s for _, s in self.factorisations[0])

    def size(self, *dims: str) -> int:
        """The number of ranks in a sub-grid spanning `dims` (1 for none)."""
        return prod(self._factorisation(dims)[1][d] for d in dims)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of `rank` on every dimension of every factorisation."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of size {self.world}")
        out: dict[str, int] = {}
        for f in self.factorisations:
            rest = rank
            for name, size in f:
                rest, out[name] = divmod(rest, size)
        return out

    def rank(self, **coords: int) -> int:
        """The global rank with these coordinates (every dimension of one factorisation, each in range)."""
        f, _ = self._factorisation(tuple(coords), exact=True)
        rank = 0
        for name, size in reversed(f):
            if not 0 <= coords[name] < size:
                raise ValueError(f"coordinate {name}={coords[name]} outside 0..{size - 1}")
            rank = rank * size + coords[name]
        return rank

    def group(self, rank: int, *dims: str) -> list[int]:
        """The ranks of `rank`'s sub-grid spanning `dims`, in order of their index in it (= sorted order:
        a slower digit is more significant in the rank, too)."""
        f, _ = self._factorisation(dims)
        here = self.coords(rank)
        spanned = [(n, s) for n, s in f if n in dims]
        members = []
        for index in range(self.size(*dims)):
            at = dict(here)
            for name, size in spanned:
                index, at[name] = divmod(index, size)
            members.append(self.rank(**{n: at[n] for n, _ in f}))
        return members

    def index_in(self, rank: int, *dims: str) -> int:
        """`rank`'s position in its sub-grid spanning `dims` (its index in `group`)."""
        f, _ = self._factorisation(dims)
        here = self.coords(rank)
        index = 0
        for name, size in reversed([(n, s) for n, s in f if n in dims]):
            index = index * size + here[name]
        return index

    def groups(self, *dims: str) -> list[list[int]]:
        """Every sub-grid spanning `dims` (each rank in exactly one), sorted, each in index order."""
        seen: set[int] = set()
        out = []
        for r in range(self.world):
            if r not in seen:
                out.append(self.group(r, *dims))
                seen.update(out[-1])
        return out

    def _factorisation(self, dims: tuple[str, ...], exact: bool = False) -> tuple[Factorisation, dict[str, int]]:
        """The first factorisation that has every dimension in `dims` (all of its dims, when `exact`)."""
        for f in self.factorisations:
            sizes = dict(f)
            if set(dims) <= set(sizes) and (not exact or set(dims) == set(sizes)):
                return f, sizes
        raise ValueError(f"no factorisation of the grid {self.factorisations} has exactly/all of {dims}")
