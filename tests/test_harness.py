"""The multi-process harness itself, and the pure rank arithmetic of ParallelState."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.parallel.state import coords_rank, group_ranks, rank_coords


def _all_reduce_rank(rank: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure")
    return rank


def test_gloo_all_reduce_across_4_ranks(dist_world) -> None:
    assert dist_world(4).run(_all_reduce_rank) == [6.0] * 4


def test_failure_names_the_rank_and_world_recovers(dist_world) -> None:
    world = dist_world(2)
    with pytest.raises(AssertionError, match=r"rank 1 failed in _fail_on_rank_one(.|\n)*deliberate failure"):
        world.run(_fail_on_rank_one)
    assert world.run(_all_reduce_rank) == [1.0, 1.0]


def test_rank_grid_tp_fastest_then_dp_then_pp() -> None:
    tp, pp, dp = 2, 2, 3
    assert [rank_coords(r, tp, pp, dp)[:3] for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    for r in range(tp * pp * dp):
        assert coords_rank(*rank_coords(r, tp, pp, dp)[:3], tp, dp) == r
    assert group_ranks("tp", tp, pp, dp)[0] == [0, 1]
    assert group_ranks("dp", tp, pp, dp)[0] == [0, 2, 4]
    assert group_ranks("pp", tp, pp, dp)[0] == [0, 6]
    assert group_ranks("mp", tp, pp, dp)[0] == [0, 1, 6, 7]
    assert group_ranks("embedding", tp, pp, dp)[0] == [0, 6]
    for kind in ("tp", "dp", "pp", "mp"):  # every rank in exactly one group of each kind
        flat = sorted(r for g in group_ranks(kind, tp, pp, dp) for r in g)
        assert flat == list(range(tp * pp * dp))


def test_rank_grid_with_cp_tp_then_cp_then_dp_then_pp() -> None:
    """cp sits between tp and dp; the cp groups agree with megalite.context's ring order."""
    from megalite.context import context_group_ranks
    from megalite.parallel.state import ParallelState
    tp, cp, pp, dp = 2, 2, 2, 2
    assert tuple(rank_coords(6, tp, pp, dp, cp)) == (0, 1, 0, 1)  # (tp, dp, pp, cp)
    for r in range(16):
        c = rank_coords(r, tp, pp, dp, cp)
        assert coords_rank(c.tp, c.dp, c.pp, tp, dp, c.cp, cp) == r
    assert group_ranks("cp", tp, pp, dp, cp) == context_group_ranks(tp, cp, pp, dp)
    assert group_ranks("dp", tp, pp, dp, cp)[0] == [0, 4]
    assert group_ranks("dp_cp", tp, pp, dp, cp)[0] == [0, 2, 4, 6]
    assert group_ranks("pp", tp, pp, dp, cp)[0] == [0, 8]
    assert group_ranks("mp", tp, pp, dp, cp)[0] == [0, 1, 8, 9]
    for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):  # every rank in exactly one group of each kind
        assert sorted(r for g in group_ranks(kind, tp, pp, dp, cp) for r in g) == list(range(16))
    for r in range(16):  # a state's rank_in is its index in its own group, size its group's size
        state = ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=r)
        for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):
            mine = next(g for g in group_ranks(kind, tp, pp, dp, cp) if r in g)
            assert (state.size(kind), state.rank_in(kind)) == (len(mine), mine.index(r)), (r, kind)
    assert ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=3).next_rank == 11
