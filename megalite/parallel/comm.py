"""Counted collectives and Megatron's conjugate autograd operators.

Every collective and point-to-point message megalite issues goes through this module, which records
wire bytes in `state.counter` under the group's counter key (`CountKey`: the group's own name, "pp" for
all four pipeline communicators, or an explicit `count_as`). Group kinds and counter keys are closed sets
(`Literal` types, checked at every entry here whatever the group size), so a typo fails at once.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3) needs two conjugate operators:

    f = CopyToTP:      forward identity,   backward all-reduce   (before a column-parallel linear)
    g = ReduceFromTP:  forward all-reduce, backward identity     (after a row-parallel linear)

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) replaces them by

    g-bar = GatherFromSequence:        forward all-gather(seq),     backward reduce-scatter(seq)
    g-bar* = ReduceScatterToSequence:  forward reduce-scatter(seq), backward all-gather(seq)

which move the same bytes as one all-reduce but keep norms/dropout/residuals on 1/tp of the
sequence. Activations are [batch, seq, hidden]: the sequence dim is 1, the hidden/vocab dim is -1.
"""

from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from megalite.parallel.counter import CountKey, check_count_key
from megalite.parallel.state import PP_KINDS, GroupKind, ParallelState, check_group

SEQ_DIM = 1

# The counter key of each group kind's own traffic: every pipeline communicator (one per kind and direction)
# is 'pp', and the gradient reduction over dp x cp (dp_cp) is still the data-parallel traffic 'dp'.
GROUP_COUNT_KEY: dict[GroupKind, CountKey] = {"tp": "tp", "dp": "dp", "mp": "mp", "embedding": "embedding", "cp": "cp",
                                              "dp_cp": "dp", **{kind: "pp" for kind in PP_KINDS},
                                              # Expert replicas reduce gradients like dp; the MoE dispatch
                                              # all-to-all files under its own key.
                                              "edp": "dp", "ep": "ep"}


# Every counted collective and message runs outside torch.compile's graphs (`model.compile`, a documented graph
# break, docs/performance.md): the byte counter is Python run per call, which a graph would run once, at trace time.
OUTSIDE_GRAPH = "megalite counts this collective's bytes in Python, once per call"
# Each wrapped function's slot: the plain function until `keep_outside_graphs` swaps in its torch.compiler.disable'd
# self. Marking at import would import dynamo (and inductor, triton) into every process, compiled or not: +1.6 s of
# CPU and ~145 MiB of RSS per rank on this CPU build. A process-wide registry, written once, like torch's own.
_OUTSIDE: list[tuple[list[Callable[..., Any]], Callable[..., Any], str]] = []


def outside_graph(fn: Callable[..., Any], reason: str = OUTSIDE_GRAPH) -> Callable[..., Any]:
    """Keep `fn` out of torch.compile's graphs (a graph break, dynamo reports `reason`) once `keep_outside_graphs`
    has run. The reason is the collectives' unless given (the MoE layer's data-dependent shapes give theirs)."""
    slot: list[Callable[..., Any]] = [fn]
    _OUTSIDE.append((slot, fn, reason))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return slot[0](*args, **kwargs)

    return call


def keep_outside_graphs() -> None:
    """Mark every `outside_graph` function for dynamo (megalite/model/compile.py calls it before compiling)."""
    for slot, fn, reason in _OUTSIDE:
        if slot[0] is fn:
            slot[0] = torch.compiler.disable(fn, reason=reason)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count_key(group: GroupKind, count_as: CountKey | None) -> CountKey:
    """Where the bytes of a call over `group` are filed; checks both names, so a typo fails even at size 1."""
    key = GROUP_COUNT_KEY[check_group(group)]
    return key if count_as is None else check_count_key(count_as)


@outside_graph
def all_reduce(t: torch.Tensor, state: ParallelState, group: GroupKind,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, count_as: CountKey | None = None) -> torch.Tensor:
    """In-place all-reduce of `t` over `group`; returns `t`. `count_as` files the bytes under another
    key (e.g. 'metrics' for the loss average, so 'dp' holds exactly the gradient traffic)."""
    key = _count_key(group, count_as)
    n = state.size(group)
    if n == 1:
        return t
    state.counter.record(key, "all_reduce", _nbytes(t), n)
    dist.all_reduce(t, op=op, group=state.group(group))
    return t


@outside_graph
def all_gather(t: torch.Tensor, state: ParallelState, group: GroupKind, dim: int) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (rank order)."""
    key = _count_key(group, None)
    n = state.size(group)
    if n == 1:
        return t
    t = t.contiguous()
    state.counter.record(key, "all_gather", _nbytes(t) * n, n)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=state.group(group))
    return torch.cat(parts, dim=dim)


def all_gather_object(obj: Any, state: ParallelState, group: GroupKind, count_as: CountKey) -> list[Any]:
    """Every rank's picklable `obj` over `group` (rank order): small host-side state such as the data streams'
    positions at a checkpoint. Counted as an all-gather of the pickled bytes."""
    n = state.size(group)
    if n == 1:
        return [obj]
    state.counter.record(check_count_key(count_as), "all_gather", len(pickle.dumps(obj)) * n, n)
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=state.group(group))
    return out


@outside_graph
def reduce_scatter(t: torch.Tensor, state: ParallelState, group: GroupKind, dim: int) -> torch.Tensor:
    """Sum `t` over the group and keep this rank's 1/n chunk along `dim`."""
    key = _count_key(group, None)
    n = state.size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    state.counter.record(key, "reduce_scatter", _nbytes(t), n)
    chunks = [c.contiguous() for c in t.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=state.group(group))
    return out


@outside_graph
def all_to_all(t: torch.Tensor, state: ParallelState, group: GroupKind) -> torch.Tensor:
    """Chunk j of `t` along dim 0 (of n equal chunks) goes to the group's rank j; returns the chunks
    received, chunk r from rank r, in the same shape (DeepSpeed-Ulysses' exchange, megalite/context/a2a.py).
    `all_to_all_single` with equal splits: counted as the (n-1)/n of `t` that leaves this rank."""
    n = state.size(group)
    if n == 1:
        return t
    if t.shape[0] % n:
        raise ValueError(f"all_to_all: dim 0 of size {t.shape[0]} not divisible by {n}")
    splits = [t.shape[0] // n] * n
    return all_to_all_single(t, state, group, splits, splits).view_as(t)


def split(t: torch.Tensor, state: ParallelState, group: GroupKind, dim: int) -> torch.Tensor:
    """This rank's 1/n chunk of `t` along `dim`, in the group's rank order (no communication)."""
    n = state.size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"split: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    return t.chunk(n, dim=dim)[state.rank_in(group)].contiguous()


@outside_graph
def all_to_all_single(t: torch.Tensor, state: ParallelState, group: GroupKind, send_splits: list[int],
                      recv_splits: list[int], count_as: CountKey | None = None) -> torch.Tensor:
    """Rank i sends rows [sum(send_splits[:j]), +send_splits[j]) of `t` (dim 0) to rank j of `group` and
    receives `recv_splits[j]` rows from each rank j, concatenated in rank order. Splits may be 0 (a rank
    that sends or receives nothing is normal: MoE routing). Counted as the bytes sent to the *other*
    ranks (op 'all_to_all'; the rows a rank keeps do not cross a link), under `count_as` when given."""
    key = _count_key(group, count_as)
    n = state.size(group)
    if len(send_splits) != n or len(recv_splits) != n or sum(send_splits) != t.shape[0]:
        raise ValueError(f"all_to_all_single: splits {send_splits} / {recv_splits} do not fit {n} ranks and "
                         f"{t.shape[0]} rows")
    if n == 1:
        return t
    t = t.contiguous()
    row = t.element_size() * math.prod(t.shape[1:])  # bytes of one row
    me = state.rank_in(group)
    state.counter.record(key, "all_to_all", row * (sum(send_splits) - send_splits[me]), n)
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t, recv_splits, send_splits, group=state.group(group))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState, group: GroupKind,  # type: ignore[override]
                send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.args = (state, group, send, recv)
        return all_to_all_single(x, state, group, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        state, group, send, recv = ctx.args
        return all_to_all_single(grad.contiguous(), state, group, recv, send), None, None, None, None


def all_to_all_rows(x: torch.Tensor, state: ParallelState, group: GroupKind, send_splits: list[int],
                    recv_splits: list[int]) -> torch.Tensor:
    """`all_to_all_single` with autograd: the backward sends each row's gradient back where it came from."""
    return x if state.size(group) == 1 else _AllToAll.apply(x, state, group, send_splits, recv_splits)


# ---------------------------------------------------------------- Megatron f / g (tensor parallel)
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        ctx.state = state
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_reduce(grad.contiguous(), ctx.state, "tp"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(x.clone(), state, "tp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        ctx.state = state
        return all_gather(x, state, "tp", dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return split(grad, ctx.state, "tp", dim=-1), None


# ---------------------------------------------------------------- sequence parallel
class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        ctx.state = state
        return all_gather(x, state, "tp", dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return reduce_scatter(grad, ctx.state, "tp", dim=SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        ctx.state = state
        return reduce_scatter(x, state, "tp", dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_gather(grad, ctx.state, "tp", dim=SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return x if state.tp == 1 else _CopyToTP.apply(x, state)


def reduce_from_tp(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return x if state.tp == 1 else _ReduceFromTP.apply(x, state)


def gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    return x if state.tp == 1 else _GatherLastDim.apply(x, state)


def gather_from_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """SP entry to a TP region: all-gather the sequence forward, reduce-scatter backward."""
    return x if state.tp == 1 else _GatherFromSequence.apply(x, state)


def reduce_scatter_to_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """SP exit from a TP region: reduce-scatter the sequence forward, all-gather backward."""
    return x if state.tp == 1 else _ReduceScatterToSequence.apply(x, state)


# ---------------------------------------------------------------- async (overlapped) collectives
# Used by the ZeRO optimizer to overlap gradient reduction with backward and parameter gathers with
# compute. Each returns the torch `Work` handle (None when the group has one rank: nothing to wait for)
# and counts its bytes exactly like the blocking form above.
@outside_graph
def all_reduce_async(t: torch.Tensor, state: ParallelState, group: GroupKind) -> dist.Work | None:
    """Start an in-place SUM all-reduce of the contiguous `t` over `group`."""
    key = _count_key(group, None)
    n = state.size(group)
    if n == 1:
        return None
    state.counter.record(key, "all_reduce", _nbytes(t), n)
    return dist.all_reduce(t, group=state.group(group), async_op=True)


@outside_graph
def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, state: ParallelState,
                         group: GroupKind) -> dist.Work | None:
    """Start a SUM reduce-scatter of the flat `t` (numel divisible by n) into `out` (numel/n):
    rank i receives the sum of every rank's i-th contiguous chunk."""
    key = _count_key(group, None)
    n = state.size(group)
    if n == 1:
        out.copy_(t)
        return None
    if t.numel() != out.numel() * n:
        raise ValueError(f"reduce_scatter_async: input {t.numel()} != {n} x output {out.numel()}")
    state.counter.record(key, "reduce_scatter", _nbytes(t), n)
    return dist.reduce_scatter(out, list(t.reshape(-1).chunk(n)), group=state.group(group), async_op=True)


@outside_graph
def all_gather_async(out: torch.Tensor, shard: torch.Tensor, state: ParallelState,
                     group: GroupKind, count_as: CountKey | None = None) -> dist.Work | None:
    """Start gathering every rank's contiguous `shard` into the flat `out` (n x shard.numel(), rank order)."""
    key = _count_key(group, count_as)
    n = state.size(group)
    if n == 1:
        out.copy_(shard.reshape(-1))
        return None
    if out.numel() != shard.numel() * n:
        raise ValueError(f"all_gather_async: output {out.numel()} != {n} x shard {shard.numel()}")
    state.counter.record(key, "all_gather", _nbytes(shard) * n, n)
    return dist.all_gather(list(out.reshape(-1).chunk(n)), shard.contiguous(), group=state.group(group),
                           async_op=True)


# ---------------------------------------------------------------- async point-to-point exchange (context parallel)
@outside_graph
def send_recv_async(sends: list[torch.Tensor], recvs: list[torch.Tensor], state: ParallelState, group: GroupKind,
                    dst: int, src: int) -> list[dist.Work]:
    """Post, as one batch, a send of every tensor of `sends` to global rank `dst` and a receive into every
    tensor of `recvs` from global rank `src`, over `group`; return the handles. Wait on all of them before
    reading `recvs` or writing `sends`. The sender counts each tensor's bytes under the group's counter key
    (op 'send').

    One batch (`batch_isend_irecv`) so that a ring of ranks that all send first never deadlocks under
    NCCL; the ring-attention step posts it before computing, to overlap the transfer with that compute.
    """
    if not all(t.is_contiguous() for t in [*sends, *recvs]):
        raise ValueError("send_recv_async: every tensor must be contiguous (the transfer reads its storage)")
    key = _count_key(group, None)
    pg = state.group(group)
    ops = [dist.P2POp(dist.isend, t, dst, group=pg) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, src, group=pg) for t in recvs]
    for t in sends:
        state.counter.record(key, "send", _nbytes(t), 2)
    return dist.batch_isend_irecv(ops) if ops else []


# ---------------------------------------------------------------- point-to-point posted together (pipeline)
class P2PWork(Protocol):
    def wait(self) -> object: ...
    def is_completed(self) -> bool: ...


@dataclass(frozen=True)
class P2PMessage:
    """One send (of `tensor`) or receive (into `tensor`) between this rank and global rank `peer`."""
    tensor: torch.Tensor
    peer: int
    tag: int
    group: GroupKind
    send: bool


@outside_graph
def post_p2p(messages: list[P2PMessage], state: ParallelState) -> list[P2PWork]:
    """Post every send and receive of `messages` now, in the order given; return one handle per message.
    Sends are counted by the sender under the group's counter key (op 'send'); receives are not
    counted (the hang watchdog learns of a receive when the caller waits on it).

    Each message is its own operation, deliberately not one `batch_isend_irecv`: on gloo that call is the
    same loop (gloo does not coalesce), and on NCCL it would make each communicator's batch one NCCL group
    on one stream, so a receive posted ahead would hold back every send posted after it on that
    communicator, whatever its peer: a deadlock of 1F1B, interleaved 1F1B and ZB-H1 once two receives are
    prefetched (tests/test_pipeline_p2p.py replays NCCL's rules). Alone, NCCL runs each pair of ranks on its own
    stream. Every tensor must be contiguous: the transfer reads and writes its storage."""
    works: list[P2PWork] = []
    for i, m in enumerate(messages):
        if not m.tensor.is_contiguous():
            raise ValueError(f"post_p2p: message {i} (tag {m.tag}) is not contiguous")
        pg = state.group(check_group(m.group))
        if m.send:
            state.counter.record(GROUP_COUNT_KEY[m.group], "send", _nbytes(m.tensor), 2)
            work = dist.isend(m.tensor, m.peer, group=pg, tag=m.tag)
        else:
            work = dist.irecv(m.tensor, m.peer, group=pg, tag=m.tag)
        assert work is not None, "isend/irecv return None only to a rank outside the group"
        works.append(work)
    return works
