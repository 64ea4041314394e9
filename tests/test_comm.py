"""`megalite.parallel.comm`: group kinds and counter keys are closed sets, and point-to-point messages are
counted like every collective.

A typo'd group kind or counter key must fail at the first call that names it, also where the group has one
rank and the call would otherwise return early without communicating (the single-process run would then
hide the typo until the first multi-rank launch).
"""

from __future__ import annotations

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.counter import COUNT_KEYS, CommCounter
from megalite.parallel.state import GROUP_KINDS, PP_KINDS, GroupKind, ParallelState
from tests.parallel_utils import layout

_ONE_RANK_CALLS = {
    "all_reduce": lambda t, st, g: comm.all_reduce(t, st, g),
    "all_gather": lambda t, st, g: comm.all_gather(t, st, g, dim=0),
    "reduce_scatter": lambda t, st, g: comm.reduce_scatter(t, st, g, dim=0),
    "split": lambda t, st, g: comm.split(t, st, g, dim=0),
    "all_reduce_async": lambda t, st, g: comm.all_reduce_async(t, st, g),
    "reduce_scatter_async": lambda t, st, g: comm.reduce_scatter_async(torch.empty_like(t), t, st, g),
    "all_gather_async": lambda t, st, g: comm.all_gather_async(torch.empty_like(t), t, st, g),
    "post_p2p": lambda t, st, g: comm.post_p2p([comm.P2PMessage(t, 0, 0, g, send=True)], st),
}


@pytest.mark.parametrize("call", sorted(_ONE_RANK_CALLS))
def test_a_typo_in_a_group_kind_fails_at_once(call: str) -> None:
    with pytest.raises(ValueError, match="unknown process-group kind 'dpp'"):
        _ONE_RANK_CALLS[call](torch.ones(4), ParallelState(), "dpp")


def test_a_typo_in_a_counter_key_fails_at_once() -> None:
    st = ParallelState()
    with pytest.raises(ValueError, match="unknown communication counter key 'metric'"):
        comm.all_reduce(torch.ones(2), st, "dp", count_as="metric")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown communication counter key 'checkpionts'"):
        comm.all_gather_async(torch.ones(2), torch.ones(2), st, "dp", count_as="checkpionts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown communication counter key 'pp_grad'"):
        CommCounter().record("pp_grad", "send", 8, 2)  # type: ignore[arg-type]  (a group, not a key)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        CommCounter().record("dp", "allreduce", 8, 2)  # type: ignore[arg-type]


def test_state_and_rank_grid_reject_unknown_kinds() -> None:
    st = ParallelState(tp=2, pp=2, dp=2)
    for bad in ("TP", "sp", "world", ""):
        for fn in (st.size, st.group, st.rank_in, st.ranks, st.group_ranks):
            with pytest.raises(ValueError, match="unknown process-group kind"):
                fn(bad)  # type: ignore[arg-type]


def test_every_group_kind_files_its_bytes_under_a_counter_key() -> None:
    assert set(comm.GROUP_COUNT_KEY) == GROUP_KINDS
    assert set(comm.GROUP_COUNT_KEY.values()) <= COUNT_KEYS
    assert all(comm.GROUP_COUNT_KEY[k] == "pp" for k in PP_KINDS)  # every pipeline communicator: 'pp' in metrics
    # The public contract of metrics.jsonl's comm_bytes keys (docs/tracking.md, docs/parallelism.md).
    assert COUNT_KEYS == {"tp", "dp", "pp", "mp", "embedding", "norm", "metrics", "checkpoint", "cp", "ep",
                          "muon"}  # ep: MoE; muon: megalite.optim.muon_exchange


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 3), (4, 1, 2), (1, 3, 1)])
def test_rank_in_is_the_position_in_the_sorted_group(tp: int, pp: int, dp: int) -> None:
    """`comm.split` picks chunk `rank_in(kind)`: it must be where the rank sits in its group's rank order,
    the order in which all_gather concatenates (so split inverts all_gather over every kind, 'mp' included)."""
    for kind in sorted(GROUP_KINDS):
        for ranks in ParallelState(tp=tp, pp=pp, dp=dp).group_ranks(kind):  # type: ignore[arg-type]
            for pos, r in enumerate(ranks):
                st = ParallelState(tp=tp, pp=pp, dp=dp, rank=r)
                assert st.rank_in(kind) == pos, (kind, r)  # type: ignore[arg-type]
                assert st.size(kind) == len(ranks), (kind, r)  # type: ignore[arg-type]


def _p2p(rank: int) -> dict[str, object]:
    """Rank 0 (stage 0) sends an activation over 'pp' and rank 1 (stage 1) a gradient over 'pp_grad'."""
    st = layout(1, pp=2)
    act = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    grad = torch.arange(5, dtype=torch.float64) - rank
    def post(t: torch.Tensor, peer: int, tag: int, group: GroupKind, send: bool) -> comm.P2PWork:
        return comm.post_p2p([comm.P2PMessage(t, peer, tag, group, send)], st)[0]

    if rank == 0:
        send = post(act, 1, 2, "pp", True)
        got = torch.empty(5, dtype=torch.float64)
        post(got, 1, 3, "pp_grad", False).wait()
    else:
        got = torch.empty(2, 3)
        post(got, 0, 2, "pp", False).wait()
        send = post(grad, 0, 3, "pp_grad", True)
    send.wait()
    return {"got": got, "pp": st.counter.exact_bytes("pp"), "bytes": st.counter.bytes(),
            "calls": st.counter.calls(),
            "pp_groups": len({id(st.group(k)) for k in PP_KINDS if st.group(k) is not None})}


def test_p2p_moves_tensors_and_the_sender_counts_them_under_pp(dist_world) -> None:
    r0, r1 = dist_world(2).run(_p2p)
    assert torch.equal(r1["got"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(r0["got"], torch.arange(5, dtype=torch.float64) - 1)
    # A send counts its payload once, on the sender: 6 fp32 = 24 bytes, 5 fp64 = 40 bytes; no other key.
    assert (r0["pp"], r1["pp"]) == (24, 40)
    assert r0["bytes"] == {"pp": 24.0} and r1["bytes"] == {"pp": 40.0}
    assert r0["calls"] == {"pp": 1} and r1["calls"] == {"pp": 1}
    assert r0["pp_groups"] == r1["pp_groups"] == 4  # one communicator per kind and direction (create_groups)
