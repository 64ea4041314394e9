"""The multi-process harness itself, and the pure rank arithmetic of ParallelState."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megalite.parallel.state import ParallelState, layout_grid


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


def _make_groups_and_count_threads(rank: int, groups: int) -> int:
    import os
    kept = [dist.new_group([0, 1]) for _ in range(groups)]  # noqa: F841 (alive until the task returns)
    return len(os.listdir("/proc/self/task"))


def _count_threads(rank: int) -> int:
    import os
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_groups_a_task_made_are_gone_before_the_next(dist_world) -> None:
    """A gloo group holds three threads; a pool rank that kept every test's groups slowed the whole suite."""
    world = dist_world(2)
    before = world.run(_count_threads)
    during = world.run(_make_groups_and_count_threads, 8)
    after = world.run(_count_threads)
    assert all(d >= b + 8 for b, d in zip(before, during))  # the groups did start their threads
    assert after == before


def test_rank_grid_tp_fastest_then_dp_then_pp() -> None:
    tp, pp, dp = 2, 2, 3
    g = layout_grid(tp=tp, pp=pp, dp=dp)
    assert [(c["tp"], c["dp"], c["pp"]) for c in map(g.coords, range(4))] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    for r in range(tp * pp * dp):
        c = g.coords(r)
        assert g.rank(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r
    st = ParallelState(tp=tp, pp=pp, dp=dp)
    assert st.group_ranks("tp")[0] == [0, 1]
    assert st.group_ranks("dp")[0] == [0, 2, 4]
    assert st.group_ranks("pp")[0] == [0, 6]
    assert st.group_ranks("mp")[0] == [0, 1, 6, 7]
    assert st.group_ranks("embedding")[0] == [0, 6]
    for kind in ("tp", "dp", "pp", "mp"):  # every rank in exactly one group of each kind
        flat = sorted(r for g in st.group_ranks(kind) for r in g)
        assert flat == list(range(tp * pp * dp))


def test_rank_grid_with_cp_tp_then_cp_then_dp_then_pp() -> None:
    """cp sits between tp and dp; the cp groups agree with megalite.context's ring order."""
    from megalite.context.group import ContextGroup
    tp, cp, pp, dp = 2, 2, 2, 2
    st = ParallelState(tp=tp, pp=pp, dp=dp, cp=cp)
    assert layout_grid(tp=tp, cp=cp, dp=dp, pp=pp).coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0, "ep": 0, "edp": 3}
    assert [list(ContextGroup.of(ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=g[0])).ranks)
            for g in st.group_ranks("cp")] == st.group_ranks("cp")
    assert st.group_ranks("dp")[0] == [0, 4]
    assert st.group_ranks("dp_cp")[0] == [0, 2, 4, 6]
    assert st.group_ranks("pp")[0] == [0, 8]
    assert st.group_ranks("mp")[0] == [0, 1, 8, 9]
    for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):  # every rank in exactly one group of each kind
        assert sorted(r for g in st.group_ranks(kind) for r in g) == list(range(16))
    for r in range(16):  # a state's rank_in is its index in its own group, size its group's size
        state = ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=r)
        for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):
            mine = next(g for g in st.group_ranks(kind) if r in g)
            assert (state.size(kind), state.rank_in(kind)) == (len(mine), mine.index(r)), (r, kind)
    assert ParallelState(tp=tp, pp=pp, dp=dp, cp=cp, rank=3).next_rank == 11
