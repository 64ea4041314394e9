"""The pipeline's point-to-point layer (`megalite/pipeline/p2p.py`): message routes, the order both
sides post them in, the receive prefetch, and every schedule at several prefetch depths against the
single-process run (the parity check itself is tests/test_pipeline.py's `run_pipeline_check`)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Callable

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.state import ParallelState
from megalite.pipeline import p2p
from megalite.pipeline.partition import stage_rank
from megalite.pipeline.schedules import SCHEDULES, build_schedule, chunk_stages
from tests.test_pipeline import run_pipeline_check


def _vpp(name: str) -> int:
    return 2 if name in ("interleaved", "zbv") else 1


def _plans(name: str, pp: int, m: int) -> list[list[p2p.Route]]:
    vpp = _vpp(name)
    plans = []
    for r in range(pp):
        acts = build_schedule(name, m, pp, r, vpp)
        plans.append(p2p.routes(acts, chunk_stages(name, r, pp, vpp), pp * vpp,
                                lambda vs: stage_rank(vs, pp, name == "zbv"), lambda pp_rank: pp_rank))
    return plans


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_both_sides_post_messages_in_the_same_order(name: str, pp: int, m: int) -> None:
    """NCCL matches sends to receives by posting order per communicator and peer (gloo by tag). The
    engine posts receives and sends in action order; for every schedule, the sequence of tags a rank
    sends to a peer on a communicator must be the sequence that peer receives from it there, and every
    message must have exactly one receiver (none lost, none doubled)."""
    plans = _plans(name, pp, m)
    sent: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    received: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for rank, plan in enumerate(plans):
        for route in plan:
            if route.send is not None and route.send.peer != rank:
                sent[(rank, route.send.peer, route.send.channel)].append(route.send.tag)
            if route.recv is not None and route.recv.peer != rank:
                received[(route.recv.peer, rank, route.recv.channel)].append(route.recv.tag)
    assert sent == received
    for tags in sent.values():
        assert len(set(tags)) == len(tags)
    # One activation and one gradient per micro-batch across each remote stage boundary.
    v = pp * _vpp(name)
    remote = sum(stage_rank(s, pp, name == "zbv") != stage_rank(s + 1, pp, name == "zbv") for s in range(v - 1))
    assert sum(map(len, sent.values())) == 2 * m * remote


class _Recorder:
    """Stands in for `comm.post_p2p` on one process: records each batch and completes every op at once."""

    class _Done:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def __init__(self) -> None:
        self.batches: list[list[comm.P2PMessage]] = []

    def __call__(self, messages: list[comm.P2PMessage], state: ParallelState) -> list[comm.P2PWork]:
        self.batches.append(list(messages))
        return [self._Done() for _ in messages]


@pytest.mark.parametrize("name,rank", [("1f1b", 1), ("interleaved", 0), ("interleaved", 1), ("zb-h1", 1),
                                       ("zbv", 0), ("gpipe", 1)])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_receives_are_posted_ahead_with_the_previous_send(monkeypatch, name: str, rank: int, depth: int) -> None:
    """Drive an Exchange through a rank's list as the engine does: before action i computes, the
    receives of the next `depth` receiving actions are already posted (so their transfer overlaps the
    compute), receives go out in action order, and an action's send is posted in one batch with the
    receives that become due after it."""
    pp, m = 2, 4
    plan = _plans(name, pp, m)[rank]
    recorder = _Recorder()
    monkeypatch.setattr(comm, "post_p2p", recorder)
    state = ParallelState(pp=pp, rank=rank)
    ex = p2p.Exchange(state, plan, (1, 2, 3), torch.float32, depth)
    remote = [i for i, r in enumerate(plan) if r.recv is not None and r.recv.peer != rank]
    ex.start()
    for i, route in enumerate(plan):
        posted = [msg.tag for batch in recorder.batches for msg in batch if not msg.send]
        later = [j for j in remote if j > i]
        # Everything up to this action's receive, plus `depth` more, and nothing beyond (memory bound).
        expected = [plan[j].recv.tag for j in remote if j <= i] + [plan[j].recv.tag for j in later[:depth]]
        assert posted == expected, f"action {i}"
        if route.recv is not None:
            assert ex.receive(i).shape == (1, 2, 3)
            if route.recv.peer != rank:  # what the hang watchdog names if this wait never returns
                assert state.counter.last_op.startswith(f"recv from rank {route.recv.peer} over '{route.recv.channel}'")
        before = len(recorder.batches)
        ex.send(i, torch.zeros(1, 2, 3) if route.send is not None else None, None)
        if route.send is not None and route.send.peer != rank:
            batch = recorder.batches[before]
            assert batch[0].send and batch[0].tag == route.send.tag
            assert all(not msg.send for msg in batch[1:])
    ex.finish()


# The engine at other prefetch depths than the default, every schedule, against the single-process losses,
# parameters and pp byte count (test_pipeline.py runs the default depth): no prefetch at pp=2, and a deep one
# (3 receives ahead) at pp=4, where 8 micro-batches leave room for it.
DEPTH_CASES = [(2, 2, s, _vpp(s), 4, 0) for s in SCHEDULES] + [(4, 4, s, _vpp(s), 8, 3) for s in SCHEDULES]


@pytest.mark.parametrize("world,pp,schedule,vpp,m,depth", DEPTH_CASES)
def test_every_schedule_matches_single_process_at_any_prefetch_depth(dist_world, world, pp, schedule, vpp, m,
                                                                     depth) -> None:
    run_pipeline_check(dist_world, world, 1, pp, False, "llama", schedule, vpp, m, depth)


def test_pipeline_compare_smoke_checks_losses_against_torch_pipelining(dist_world, tmp_path) -> None:
    """The benchmark runs end to end (tiny dims, 1 step, pp=2, every schedule; its ranks are the warm 2-rank
    pool instead of two spawned processes): megalite's schedules and their torch.distributed.pipelining peers
    agree on the losses before anything is timed (the script fails otherwise), and every ratio, CPU figure and
    in-flight peak is reported. How fast anything is, it does not check."""
    from bench.pipeline_compare import PEERS, main, rank_results

    def pool(world: int, args: dict) -> dict:
        return dist_world(world).run(rank_results, world, args)[0]

    assert main(["--smoke", "--pp", "2", "--out", str(tmp_path)], launch=pool) == 0
    res = json.loads((tmp_path / "pipeline_compare_smoke.json").read_text())
    (table,) = res["results"]
    assert set(table["losses"]) == {*SCHEDULES, *(f"torch-{s}" for s in PEERS)}  # each compared to its peer
    rows = {r["schedule"]: r for r in table["rows"]}
    assert set(rows) == set(SCHEDULES)
    assert rows["1f1b"]["peak_in_flight"] == [2, 1] and rows["zb-h1"]["peak_in_flight"] == [2, 2]
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    for s in ("1f1b", "interleaved"):
        q = rows[s]["ratio_to_torch"]
        assert q["min"] > 0 and rows[s]["torch_cpu_ms_per_step"] > 0  # a ratio of two measured times
    assert "ratio_to_torch" not in rows["zb-h1"]  # no torch peer with one stage per rank
    assert "ScheduleInterleaved1F1B" in (tmp_path / "pipeline_compare_smoke.md").read_text()


# ---------------------------------------------------------------- NCCL's semantics, simulated
def _posted_batches(plan: list[p2p.Route], rank: int, depth: int) -> list[tuple[int, list[comm.P2PMessage]]]:
    """What the engine posts on `rank`, in order: (the last action launched before it, -1 at the start;
    the batch's messages), by driving an Exchange through the plan as the engine does."""
    recorder = _Recorder()
    out: list[tuple[int, list[comm.P2PMessage]]] = []
    ex = p2p.Exchange(ParallelState(pp=2, rank=rank), plan, (1,), torch.float32, depth)
    original, comm.post_p2p = comm.post_p2p, recorder  # type: ignore[assignment]
    try:
        ex.start()
        out += [(-1, b) for b in recorder.batches]
        for i, route in enumerate(plan):
            if route.recv is not None:
                ex.receive(i)
            n = len(recorder.batches)
            ex.send(i, torch.zeros(1) if route.send is not None else None, None)
            out += [(i, b) for b in recorder.batches[n:]]
        ex.finish()
    finally:
        comm.post_p2p = original  # type: ignore[assignment]
    return out


def _nccl_deadlocks(plans: list[list[p2p.Route]], depth: int, coalesced: bool = False,
                    on: Callable[[str], str] = str) -> list[str]:
    """Replay every rank's posts under NCCL's rules; return the ranks that never finish (empty: no deadlock).
    `on(channel)` is the communicator a message's channel is posted on (default: its own).

    The rules (ProcessGroupNCCL): an operation runs on a stream, one per (communicator, peer) for a lone
    isend/irecv, one per communicator for a coalesced `batch_isend_irecv` group (`coalesced`). An
    operation (group) starts when the previous one on its stream has completed and the compute launched
    before it was posted has finished (its stream waits on the compute stream); it completes once each of
    its messages has met its counterpart running on the peer (NCCL matches in posting order per peer;
    test_both_sides_post_messages_in_the_same_order holds that, so matching by tag is the same here).
    Waiting on a receive makes the compute stream wait: action i computes after action i-1 and after the
    operation holding its receive. The host never blocks."""
    groups = []  # (rank, stream, index on its stream, launched-before action, ops)
    for rank, plan in enumerate(plans):
        per_stream: dict[object, int] = defaultdict(int)
        for after, batch in _posted_batches(plan, rank, depth):
            if not coalesced:  # every message alone, one stream per (communicator, peer)
                for m in batch:
                    key = (on(m.group), m.peer)
                    groups.append((rank, key, per_stream[key], after, [(m.send, m.peer, m.tag)]))
                    per_stream[key] += 1
                continue
            for comm_name in dict.fromkeys(on(m.group) for m in batch):  # one NCCL group per communicator
                ops = [(m.send, m.peer, m.tag) for m in batch if on(m.group) == comm_name]
                groups.append((rank, comm_name, per_stream[comm_name], after, ops))
                per_stream[comm_name] += 1
    where = {}  # (rank, communicator, send?, tag) -> group id
    for g, (rank, stream, _, _, ops) in enumerate(groups):
        for send, _, tag in ops:
            where[(rank, _communicator(stream), send, tag)] = g
    recv_group = {(rank, i): where[(rank, on(r.recv.channel), False, r.recv.tag)]
                  for rank, plan in enumerate(plans) for i, r in enumerate(plan)
                  if r.recv is not None and r.recv.peer != rank}
    # The operation before each one on its stream (None: first on it), looked up once, not per sweep.
    index = {(rank, stream, k): g for g, (rank, stream, k, _, _) in enumerate(groups)}
    prev = [index.get((rank, stream, k - 1)) for rank, stream, k, _, _ in groups]
    computed = [-1] * len(plans)  # last action finished per rank
    running, complete = set(), set()
    changed = True
    while changed:
        changed = False
        for g, (rank, _, _, after, _) in enumerate(groups):
            if g not in running and computed[rank] >= after and (prev[g] is None or prev[g] in complete):
                running.add(g)
                changed = True
        for g, (rank, stream, _, _, ops) in enumerate(groups):
            if g in running and g not in complete and all(where[(peer, _communicator(stream), not send, tag)] in running
                                                          for send, peer, tag in ops):
                complete.add(g)
                changed = True
        for rank, plan in enumerate(plans):
            while computed[rank] + 1 < len(plan) and recv_group.get((rank, computed[rank] + 1), -1) in complete | {-1}:
                computed[rank] += 1
                changed = True
    return [f"rank {r} stuck before action {c + 1} of {len(p)}" for r, (c, p) in enumerate(zip(computed, plans))
            if c + 1 < len(p)]


def _communicator(stream: object) -> str:
    return stream[0] if isinstance(stream, tuple) else str(stream)


def _one_per_kind(channel: str) -> str:
    """The communicators before the split by direction: all activations on 'pp', all gradients on 'pp_grad'."""
    return "pp_grad" if channel in ("pp_grad", "pp_grad_up") else "pp"


# Layouts where one pair of ranks sends activations (and gradients) both ways: the interleaved schedule at
# pp=2 (rank 1 hands stage 1 back to rank 0) and ZB-V (the V runs back up). With one communicator per kind,
# a pair's messages both ways share one NCCL stream, and a send waits there in front of a receive from the
# same peer that the peer's matching receive needs first (gloo matches by tag and never showed it).
BOTH_WAYS = {("interleaved", 2), ("zbv", 2), ("zbv", 4), ("zbv", 8)}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 12), (8, 16)])
def test_each_communicator_carries_one_kind_one_way_per_pair(name: str, pp: int, m: int) -> None:
    """Between any two ranks, each pipeline communicator carries messages in one direction only, and
    only activations ('pp', 'pp_act_down') or only gradients ('pp_grad', 'pp_grad_up'); 1F1B, GPipe and
    ZB-H1 need only 'pp' and 'pp_grad'; the two-way layouts above are exactly those that use all four."""
    directions: dict[tuple[str, frozenset[int]], set[tuple[int, int]]] = defaultdict(set)
    for rank, plan in enumerate(_plans(name, pp, m)):
        for route in plan:
            for msg, sending in ((route.send, True), (route.recv, False)):
                if msg is not None and msg.peer != rank:
                    src, dst = (rank, msg.peer) if sending else (msg.peer, rank)
                    directions[(msg.channel, frozenset((src, dst)))].add((src, dst))
                    assert msg.channel == p2p.channel(msg.tag % 2 == 1, dst > src)
    assert all(len(ways) == 1 for ways in directions.values()), directions
    used = {channel for channel, _ in directions}
    if name in ("1f1b", "gpipe", "zb-h1"):
        assert used == {"pp", "pp_grad"}
    if (name, pp) in BOTH_WAYS:
        assert used == {"pp", "pp_act_down", "pp_grad", "pp_grad_up"}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 12), (8, 16)])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_no_schedule_deadlocks_under_nccl_rules(name: str, pp: int, m: int, depth: int) -> None:
    """Posting each message alone (`comm.post_p2p`) on its kind's and direction's communicator, with
    receives prefetched, deadlocks no schedule under NCCL's rules. The replay can fail: with one
    communicator per kind (both directions on one stream per pair) it finds the deadlock of exactly the
    two-way layouts above; and coalescing each post into one NCCL group per communicator (one
    `batch_isend_irecv`) deadlocks even 1F1B at prefetch depth 2, on the four communicators."""
    plans = _plans(name, pp, m)
    assert not _nccl_deadlocks(plans, depth)
    assert bool(_nccl_deadlocks(plans, depth, on=_one_per_kind)) == ((name, pp) in BOTH_WAYS)
    if (name, depth) == ("1f1b", 2):
        assert _nccl_deadlocks(plans, depth, coalesced=True)
