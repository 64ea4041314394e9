"""The rank grid: every group kind, for many layouts, is what the four functions it replaced computed
(`_old_*` below is a frozen copy of them, taken before the change), and the expert-parallel groups follow
the shared definition (i = dp_rank * cp + cp_rank; ep_rank = i % ep; edp_rank = i // ep) by arithmetic."""

from __future__ import annotations

import itertools

import pytest

from megalite.parallel.grid import RankGrid
from megalite.parallel.state import GROUP_KINDS, PP_KINDS, ParallelState, layout_grid

LAYOUTS = [(tp, cp, dp, pp) for tp, cp, dp, pp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3), (1, 2, 4))
           if tp * cp * dp * pp <= 48]


# --- frozen copy of the old rank arithmetic (megalite/parallel/state.py before the grid) -----------------
def _old_rank_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int, int]:
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp  # (tp, dp, pp, cp)


def _old_coords_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0,
                     cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def _old_group_ranks(kind: str, tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    spans = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp_cp": ("dp", "cp"), "mp": ("tp", "pp"),
             "embedding": ("pp",), **{k: ("pp",) for k in PP_KINDS}}[kind]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(tp * cp * pp * dp):
        c = dict(zip(("tp", "dp", "pp", "cp"), _old_rank_coords(r, tp, pp, dp, cp)))
        groups.setdefault(tuple(v for n, v in c.items() if n not in spans), []).append(r)
    result = [sorted(g) for g in groups.values()]
    if kind == "embedding":
        result = [sorted({g[0], g[-1]}) for g in result]
    return sorted(result)


def _old_size_rank_in(kind: str, tp: int, pp: int, dp: int, cp: int, rank: int) -> tuple[int, int]:
    t, d, p, c = _old_rank_coords(rank, tp, pp, dp, cp)
    if kind in PP_KINDS:
        return pp, p
    size = {"tp": tp, "dp": dp, "mp": tp * pp, "embedding": 1 if pp == 1 else 2, "cp": cp, "dp_cp": dp * cp}[kind]
    index = {"tp": t, "dp": d, "mp": p * tp + t, "embedding": 0 if p == 0 else 1, "cp": c, "dp_cp": d * cp + c}[kind]
    return size, index
# ----------------------------------------------------------------------------------------------------------


OLD_KINDS = sorted(GROUP_KINDS - {"ep", "edp"})


@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_every_group_and_coordinate_is_what_the_old_arithmetic_gave(tp: int, cp: int, dp: int, pp: int) -> None:
    world = tp * cp * dp * pp
    for kind in OLD_KINDS:
        assert ParallelState(tp=tp, pp=pp, dp=dp, cp=cp).group_ranks(kind) == _old_group_ranks(kind, tp, pp, dp, cp)
    for r in range(world):
        st = ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=r)
        assert (st.tp_rank, st.dp_rank, st.pp_rank, st.cp_rank) == _old_rank_coords(r, tp, pp, dp, cp)
        assert st.grid.rank(tp=st.tp_rank, cp=st.cp_rank, dp=st.dp_rank, pp=st.pp_rank) == r
        assert _old_coords_rank(st.tp_rank, st.dp_rank, st.pp_rank, tp, dp, st.cp_rank, cp) == r
        for kind in OLD_KINDS:
            assert (st.size(kind), st.rank_in(kind)) == _old_size_rank_in(kind, tp, pp, dp, cp, r), kind  # type: ignore[arg-type]
        for s in range(pp):
            assert st.stage_rank(s) == _old_coords_rank(st.tp_rank, st.dp_rank, s, tp, dp, st.cp_rank, cp)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_groups_are_the_shared_factorisation_of_dp_cp(ep: int) -> None:
    for tp, cp, dp, pp in LAYOUTS:
        if (dp * cp) % ep:
            with pytest.raises(ValueError, match="must divide"):
                layout_grid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
            continue
        world = tp * cp * dp * pp
        states = [ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, rank=r) for r in range(world)]
        # (tp_rank, pp_rank, ep_rank, edp_rank) of every rank, by the definition (not by the grid)
        where = [(st.tp_rank, st.pp_rank, (st.dp_rank * cp + st.cp_rank) % ep, (st.dp_rank * cp + st.cp_rank) // ep)
                 for st in states]
        for st, (t, p, ep_rank, edp_rank) in zip(states, where):
            assert st.ranks("ep") == [r for r, w in enumerate(where) if (w[0], w[1], w[3]) == (t, p, edp_rank)]
            assert st.ranks("edp") == [r for r, w in enumerate(where) if (w[0], w[1], w[2]) == (t, p, ep_rank)]
            assert (st.size("ep"), st.rank_in("ep")) == (ep, ep_rank)
            assert (st.size("edp"), st.rank_in("edp")) == (dp * cp // ep, edp_rank)
            assert (st.coords["ep"], st.coords["edp"]) == (ep_rank, edp_rank)
            if ep == 1:
                assert st.ranks("ep") == [st.rank] and st.ranks("edp") == st.ranks("dp_cp")
        assert sorted(r for g in states[0].group_ranks("ep") for r in g) == list(range(world))


def test_the_grid_reads_any_factorisation() -> None:
    g = RankGrid.of(("a", 2), ("b", 3), ("c", 2)).refactor(("a", "b"), (("x", 3), ("y", 2)))
    assert g.dims == ("a", "b", "c", "x", "y") and g.world == 12 and g.size("b", "c") == 6
    assert g.coords(7) == {"a": 1, "b": 0, "c": 1, "x": 1, "y": 0}
    assert g.rank(a=1, b=0, c=1) == g.rank(x=1, y=0, c=1) == 7
    assert g.groups("b") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert g.group(7, "y") == [7, 10] and g.index_in(7, "y") == 0 and g.index_in(10, "y") == 1
    for bad in (lambda: g.rank(a=2, b=0, c=0), lambda: g.rank(a=0, b=0), lambda: g.groups("a", "x"),
                lambda: g.refactor(("a", "c"), (("z", 4),)), lambda: g.refactor(("a", "b"), (("z", 5),)),
                lambda: RankGrid.of(("a", 0)), lambda: g.coords(12)):
        with pytest.raises(ValueError):
            bad()
