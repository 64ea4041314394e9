"""Runs one rank's schedule (a list of ("F"|"B", micro_batch, chunk) actions) for one optimizer step.

Communication rule that makes every schedule deadlock-free on gloo and NCCL alike: a rank never
blocks on a send (activations and gradients go out with `isend` and are waited on lazily), and it
blocks on a receive only right before the action that needs it. Each message carries a tag unique
to (micro-batch, virtual stage, direction), so out-of-order arrival cannot mix them up.

Memory: as soon as a stage's output has been sent, its storage is released (Megatron's
`deallocate_output_tensor`): only the autograd graph is kept, and backward is started from it with
the received gradient. So a stage holds each in-flight micro-batch's saved activations, not its output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel import comm
from megalite.parallel.state import GroupKind, ParallelState, coords_rank
from megalite.pipeline.schedules import Action

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _InFlight:
    inp: torch.Tensor | None      # received input (requires grad), None on virtual stage 0
    out: torch.Tensor             # stage output (its storage freed once sent) or the scaled loss


@dataclass
class PipelineEngine:
    chunks: list[nn.Module]                     # this rank's model chunks
    chunk_stages: list[int]                     # virtual stage of each chunk
    num_stages: int                             # V = pp * vpp
    state: ParallelState
    act_shape: tuple[int, int, int]             # [micro_batch, seq (or seq/tp under SP), hidden]
    dtype: torch.dtype
    peak_in_flight: int = 0
    _pending: list[tuple[dist.Work, torch.Tensor | None]] = field(default_factory=list)

    def _peer(self, vstage: int) -> int:
        s = self.state
        return coords_rank(s.tp_rank, s.dp_rank, vstage % s.pp, s.tp, s.dp)

    def _tag(self, micro: int, vstage: int, backward: bool) -> int:
        return (micro * self.num_stages + vstage) * 2 + int(backward)

    @staticmethod
    def _channel(tag: int) -> GroupKind:
        """Activations over the 'pp' communicator, gradients over 'pp_grad' (see create_groups)."""
        return "pp_grad" if tag % 2 else "pp"

    def _send(self, t: torch.Tensor, to_stage: int, tag: int, release: torch.Tensor | None) -> None:
        work = comm.isend(t, self.state, self._peer(to_stage), self._channel(tag), tag)
        self._pending.append((work, release))
        self._poll()

    def _recv(self, from_stage: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.state.device)
        comm.irecv(buf, self.state, self._peer(from_stage), self._channel(tag), tag).wait()
        return buf

    def _poll(self) -> None:
        """Release the storage of outputs whose send has completed."""
        still = []
        for work, release in self._pending:
            if work.is_completed():
                if release is not None:
                    release.data = torch.empty(0, dtype=release.dtype, device=release.device)
            else:
                still.append((work, release))
        self._pending = still

    def _drain(self) -> None:
        for work, release in self._pending:
            work.wait()
            if release is not None:
                release.data = torch.empty(0, dtype=release.dtype, device=release.device)
        self._pending = []

    def run(self, actions: list[Action], batches: list[Batch], loss_scale: float,
            optimizer: DistributedOptimizer | None) -> torch.Tensor:
        """Execute the schedule; returns the sum over micro-batches of the mean token loss (0 off the
        last stage). The loss is scaled by loss_scale / M for backward (gradient accumulation). Of the
        optimizer only `no_sync()` is used (None: forward-only evaluation, no backward actions)."""
        m = len(batches)
        live: dict[tuple[int, int], _InFlight] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.state.device)
        last_backward = {c: max((i for i, a in enumerate(actions) if a[0] == "B" and a[2] == c), default=-1)
                         for c in range(len(self.chunks))}
        for i, (kind, micro, c) in enumerate(actions):
            vs, chunk = self.chunk_stages[c], self.chunks[c]
            first, last = vs == 0, vs == self.num_stages - 1
            if kind == "F":
                ids, labels = (t.to(self.state.device) for t in batches[micro])
                inp = None if first else self._recv(vs - 1, self._tag(micro, vs, False))
                if inp is not None and torch.is_grad_enabled():
                    inp.requires_grad_()
                out = chunk(ids if first else None, labels if last else None, hidden=inp, dtype=self.dtype)
                if last:
                    loss = out.mean()
                    total += loss.detach().double()
                    out = loss * (loss_scale / m)
                else:
                    self._send(out.detach(), vs + 1, self._tag(micro, vs + 1, False), release=out)
                if torch.is_grad_enabled():  # evaluation runs forward-only under no_grad
                    live[(micro, c)] = _InFlight(inp, out)
                    self.peak_in_flight = max(self.peak_in_flight, len(live))
            else:
                item = live.pop((micro, c))
                # Gradients are reduced over DP only in each chunk's last backward of the step.
                assert optimizer is not None, "a schedule with backward actions needs the optimizer"
                sync = contextlib.nullcontext() if i == last_backward[c] else optimizer.no_sync()
                with sync:
                    if last:
                        item.out.backward()
                    else:
                        grad = self._recv(vs + 1, self._tag(micro, vs, True))
                        # The output's storage may be freed: bypass backward()'s shape check.
                        Variable._execution_engine.run_backward(
                            (item.out,), (grad,), False, False, (), True, True)
                if not first:
                    assert item.inp is not None and item.inp.grad is not None
                    self._send(item.inp.grad, vs - 1, self._tag(micro, vs - 1, True), release=None)
        self._drain()
        return total


def forward_only_schedule(num_micro: int, vpp: int) -> list[Action]:
    """Evaluation: every micro-batch through every chunk, in order (sends never block, so no deadlock)."""
    return [("F", m, c) for m in range(num_micro) for c in range(vpp)]
