"""The point-to-point traffic of one rank's schedule: what each action receives and sends, posted ahead.

Every action's messages are known before the step starts (`routes`): an F receives its input from the
previous virtual stage and sends its output to the next one; a B receives the output gradient from the
next stage and sends the input gradient to the previous one; a W moves nothing. So `Exchange` can post
a receive *before* the action that needs it (Megatron's overlap of p2p with compute): while this rank
computes action i, the receive of the next message it will wait for is already posted, and the peer's
send can complete as soon as the peer has computed it. On gloo that matters on its own: a sender's
data moves only once the receiver has posted the matching receive (the receiver tells the sender its
buffer is ready), so a receive posted just before it is needed puts a round trip and the whole transfer
on the critical path.

After each action, its send and the receives then due are posted together (`comm.post_p2p`), each
message its own operation (why not one coalesced `batch_isend_irecv`: see there). Each message travels
on the communicator of its kind and direction (`channel`): activations to a higher pp_rank on 'pp', to a
lower one on 'pp_act_down' (the interleaved schedule's wrap-around from the last rank to the first, the
second leg of a V); gradients to a lower pp_rank on 'pp_grad', to a higher one on 'pp_grad_up'.

Deadlock freedom, as before: a rank never blocks on a send (sends are waited on lazily, to release the
output's storage, and all at the end), and it blocks on a receive only right before the action that
needs it. Receives are posted in action order, at most `depth` ahead of the action being computed, so
the prefetch costs `depth` activation buffers at most. Each message carries a tag unique to
(micro-batch, virtual stage, direction). NCCL matches messages in posting order per communicator and
peer instead, and runs a pair's messages on one communicator on one stream, in posting order: every
schedule posts each communicator's sends and receives in the same order on both sides, and as each
communicator carries one direction only, no send can sit on a stream in front of a receive from the
same peer that it waits for. A replay of NCCL's stream rules finds no deadlock in any schedule at
prefetch depths 0 to 2; with the activations (or gradients) of both directions on one communicator, it finds one in the
interleaved schedule at pp=2 and in ZB-V (`tests/test_pipeline_p2p.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite.parallel import comm
from megalite.parallel.state import GroupKind, ParallelState
from megalite.pipeline.schedules import Action


@dataclass(frozen=True)
class Message:
    """One tensor between two virtual stages: the other side's global rank (this rank's own rank for
    the same-rank hand-off of a V placement), its tag and its communicator."""
    peer: int
    tag: int
    channel: GroupKind


@dataclass(frozen=True)
class Route:
    recv: Message | None  # what the action waits for before computing
    send: Message | None  # what it sends once computed


def message_tag(micro: int, vstage: int, backward: bool, num_stages: int) -> int:
    """The tag of the message *into* virtual stage `vstage` (forward) or *out of* it (backward)."""
    return (micro * num_stages + vstage) * 2 + int(backward)


def channel(backward: bool, upward: bool) -> GroupKind:
    """The communicator of a gradient (`backward`) or activation going to a higher pp_rank (`upward`) or a
    lower one: one per kind and direction (`parallel/state.py`'s `create_groups` says why)."""
    if backward:
        return "pp_grad_up" if upward else "pp_grad"
    return "pp" if upward else "pp_act_down"


def routes(actions: list[Action], chunk_stages: list[int], num_stages: int, stage_of: Callable[[int], int],
           rank_of: Callable[[int], int]) -> list[Route]:
    """The messages of each action of a rank's list. `stage_of(vstage)` is the pp_rank holding a virtual
    stage, `rank_of(pp_rank)` that stage's global rank in this rank's pipeline."""

    def message(micro: int, src: int, dst: int, backward: bool, incoming: bool) -> Message:
        """The message from virtual stage `src` to `dst`, seen from the receiver (`incoming`) or the sender.
        Both sides name the same communicator: the direction is that of the message, not of the rank."""
        src_pp, dst_pp = stage_of(src), stage_of(dst)
        return Message(rank_of(src_pp if incoming else dst_pp), message_tag(micro, dst, backward, num_stages),
                       channel(backward, dst_pp > src_pp))

    out = []
    for kind, micro, c in actions:
        vs = chunk_stages[c]
        first, last = vs == 0, vs == num_stages - 1
        if kind == "F":
            out.append(Route(None if first else message(micro, vs - 1, vs, False, incoming=True),
                             None if last else message(micro, vs, vs + 1, False, incoming=False)))
        elif kind == "B":
            out.append(Route(None if last else message(micro, vs + 1, vs, True, incoming=True),
                             None if first else message(micro, vs, vs - 1, True, incoming=False)))
        else:
            out.append(Route(None, None))
    return out


@dataclass
class _Posted:
    work: comm.P2PWork
    buf: torch.Tensor


@dataclass
class Exchange:
    """One step's p2p traffic on one rank: receives posted ahead in action order, sends never blocking."""
    state: ParallelState
    plan: list[Route]
    shape: tuple[int, ...]
    dtype: torch.dtype
    depth: int = 1                       # receives posted beyond the one the current action waits for
    _next_recv: int = 0                  # the first action whose receive is not posted yet
    _posted: dict[int, _Posted] = field(default_factory=dict)
    _sending: list[tuple[comm.P2PWork, torch.Tensor | None]] = field(default_factory=list)
    _local: dict[int, torch.Tensor] = field(default_factory=dict)  # same-rank hand-offs, by tag

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {self.depth}")

    def start(self) -> None:
        """Post the first receives (the first action's and `depth` more) before anything computes."""
        self._post([], self._receives_through(0))

    def receive(self, i: int) -> torch.Tensor:
        """The tensor action `i` receives, waiting for it if it has not arrived yet."""
        msg = self.plan[i].recv
        assert msg is not None, f"action {i} receives nothing"
        if msg.peer == self.state.rank:
            return self._local.pop(msg.tag)
        posted = self._posted.pop(i)  # posted at the latest by the previous action's `send`
        self.state.counter.enter(f"recv from rank {msg.peer} over '{msg.channel}' (tag {msg.tag}, "
                                 f"{posted.buf.numel() * posted.buf.element_size()} bytes)")
        posted.work.wait()
        return posted.buf

    def send(self, i: int, t: torch.Tensor | None, release: torch.Tensor | None) -> None:
        """Action `i` is done: post its send (`t`, if it sends one) together with the next receives.
        `release` is the tensor whose storage is freed once the send has completed (the stage output)."""
        msg = self.plan[i].send
        sends: list[tuple[torch.Tensor, Message, torch.Tensor | None]] = []
        if msg is not None:
            assert t is not None, f"action {i} must send a tensor"
            if msg.peer == self.state.rank:  # V placement: stage P-1 -> P on one rank
                self._local[msg.tag] = t      # `release` may go: t is its own reference to the storage
            else:
                sends.append((t.contiguous(), msg, release))
        self._post(sends, self._receives_through(i + 1))
        self._poll()

    def finish(self) -> None:
        """Wait for every send (the step's last use of their buffers)."""
        assert not self._posted, f"receives posted but never used: actions {sorted(self._posted)}"
        for work, release in self._sending:
            work.wait()
            _free(release)
        self._sending = []
        assert not self._local, "a same-rank hand-off was never received"

    def _receives_through(self, current: int) -> list[int]:
        """Actions whose receive must be posted while `current` runs: every receive up to the one
        `current` waits for, and `depth` more (skipping actions that receive nothing remotely)."""
        wanted: list[int] = []
        extra = self.depth - sum(k > current for k in self._posted)
        i = self._next_recv
        while i < len(self.plan) and (i <= current or extra > 0):
            msg = self.plan[i].recv
            if msg is not None and msg.peer != self.state.rank:
                wanted.append(i)
                if i > current:
                    extra -= 1
            i += 1
        self._next_recv = i
        return wanted

    def _post(self, sends: list[tuple[torch.Tensor, Message, torch.Tensor | None]], recv_actions: list[int]) -> None:
        if not sends and not recv_actions:
            return
        ops: list[comm.P2PMessage] = [comm.P2PMessage(t, m.peer, m.tag, m.channel, send=True) for t, m, _ in sends]
        bufs = [torch.empty(self.shape, dtype=self.dtype, device=self.state.device) for _ in recv_actions]
        for i, buf in zip(recv_actions, bufs):
            m = self.plan[i].recv
            assert m is not None
            ops.append(comm.P2PMessage(buf, m.peer, m.tag, m.channel, send=False))
        works = comm.post_p2p(ops, self.state)
        for (_, _, release), work in zip(sends, works):
            self._sending.append((work, release))
        for i, buf, work in zip(recv_actions, bufs, works[len(sends):]):
            self._posted[i] = _Posted(work, buf)

    def _poll(self) -> None:
        """Release the storage of outputs whose send has completed."""
        still = []
        for work, release in self._sending:
            if work.is_completed():
                _free(release)
            else:
                still.append((work, release))
        self._sending = still


def _free(t: torch.Tensor | None) -> None:
    """Release a sent output's memory, keeping its shape (one element broadcast over it): the engine's
    backward from it then passes torch's shape check without a private API."""
    if t is not None:
        t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)

