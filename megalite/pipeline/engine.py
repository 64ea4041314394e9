"""Runs one rank's schedule (a list of ("F"|"B"|"W", micro_batch, chunk) actions) for one optimizer step.

Communication (`p2p.py`): a rank never blocks on a send (activations and gradients are waited on
lazily), and it blocks on a receive only right before the action that needs it, which keeps every
schedule deadlock-free. Each receive is posted ahead, before the previous action computes, so the
transfer overlaps that compute; each action's send goes out together with the receives then due.

Memory: as soon as a stage's output has been sent, its storage is released (Megatron's
`deallocate_output_tensor`): only the autograd graph is kept, and backward is started from it with
the received gradient. So a stage holds each in-flight micro-batch's saved activations, not its output.

Split backwards (ZB-H1, ZB-V; `schedules.py`): for a (micro-batch, chunk) that has a "W", its "B" runs
inside the gradient sync's `defer_weight_grads(store)`, so B computes the input gradient (and the small
non-linear parameters' gradients) and the linears' weight GEMMs are recorded in the store; the W is then
`store.run()`, a plain call, which holds the linears' inputs and output gradients until then
(`layers.linear_fn`). The micro-batch stays "in flight" (`peak_in_flight`) until its W. Gradient
reduction: every B and W runs inside `no_sync()` except those of each chunk's last micro-batch (its
whole B, or its B and its W; `sync_actions`): each parameter's gradient of that micro-batch arrives
once, in one of them, and the sync starts a bucket's reduction as soon as all of its parameters have
arrived, overlapped with the rest of the backward. With a V placement (zbv) the stage after P-1 is on the same
rank: that hand-off stays local.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx.experimental.symbolic_shapes  # noqa: F401
import torch.nn as nn

from megalite.layers.linear_fn import DeferredWeightGrads
from megalite.moe.losses import ScalesAuxLoss
from megalite.parallel.state import ParallelState
from megalite.pipeline.p2p import Exchange, routes
from megalite.pipeline.partition import stage_rank
from megalite.pipeline.schedules import Action, split_backwards

Batch = tuple[torch.Tensor, torch.Tensor]


class BackwardSync(Protocol):
    """What the engine needs of the gradient sync (an optimizer's `DistributedOptimizer` has it)."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients without communicating."""
        ...

    def defer_weight_grads(self, store: DeferredWeightGrads) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside record the linears' weight-gradient work in `store`."""
        ...


def run_weight_grads(store: DeferredWeightGrads) -> None:
    """A "W" action: the weight-gradient work its "B" recorded."""
    store.run()


def sync_actions(actions: list[Action], chunks: int) -> set[int]:
    """The backward actions that run outside `no_sync()`: the B and the W of each chunk's last micro-batch
    (the one its last backward action belongs to). Other micro-batches' W's may still follow that B (they
    touch only the linears' weights, which arrive in the last W); a B may not (its gradients could land
    in a bucket whose reduction already started)."""
    out: set[int] = set()
    for c in range(chunks):
        grads = [i for i, (kind, _, cc) in enumerate(actions) if cc == c and kind != "F"]
        if not grads:
            continue
        last_micro = actions[grads[-1]][1]
        mine = [i for i in grads if actions[i][1] == last_micro]
        late = [actions[i] for i in grads if i > mine[0] and i not in mine and actions[i][0] == "B"]
        if late:
            raise ValueError(f"chunk {c}: {late} run after the last micro-batch's backward began")
        out.update(mine)
    return out


@dataclass
class _InFlight:
    inp: torch.Tensor | None      # received input (requires grad), None on virtual stage 0
    out: torch.Tensor             # stage output (its storage freed once sent) or the scaled loss
    wgrad: DeferredWeightGrads | None = None            # split backward: the W's work, recorded in B


@dataclass
class PipelineEngine:
    chunks: list[nn.Module]                     # this rank's model chunks
    chunk_stages: list[int]                     # virtual stage of each chunk
    num_stages: int                             # V = pp * vpp
    state: ParallelState
    act_shape: tuple[int, int, int]             # [micro_batch, seq (or seq/tp under SP), hidden]
    dtype: torch.dtype
    v_shape: bool = False                       # ZB-V placement (`partition.chunk_virtual_stages`)
    peak_in_flight: int = 0
    p2p_depth: int = 1                          # receives posted ahead of the one being waited for
    _exchange: Exchange | None = None           # this step's p2p traffic (`p2p.py`)
    _divisor: float | None = None               # this step's `loss_divisor` (None: mean per micro-batch)
    _loss_scale: float = 1.0

    def _pp_rank(self, vstage: int) -> int:
        return stage_rank(vstage, self.state.pp, self.v_shape)

    def run(self, actions: list[Action], batches: list[Batch], loss_scale: float,
            optimizer: BackwardSync | None, loss_divisor: float | None = None) -> torch.Tensor:
        """Execute the schedule; returns the sum over micro-batches of the mean token loss (0 off the
        last stage). The loss is scaled by loss_scale / M for backward (gradient accumulation). Of the
        optimizer only `no_sync()` and `defer_weight_grads()` are used (None: forward-only evaluation,
        no backward actions).

        `loss_divisor` D (a global token mean, `training.step`): each micro-batch's loss is instead its sum of
        token losses / D, backpropagated with loss_scale alone, and the return value is the sum of those."""
        m = len(batches)
        self._divisor, self._loss_scale = loss_divisor, loss_scale
        live: dict[tuple[int, int], _InFlight] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.state.device)
        split = split_backwards(actions)
        synced = sync_actions(actions, len(self.chunks))
        plan = routes(actions, self.chunk_stages, self.num_stages, self._pp_rank, self.state.stage_rank)
        self._exchange = ex = Exchange(self.state, plan, self.act_shape, self.dtype, self.p2p_depth)
        ex.start()
        for i, (kind, micro, c) in enumerate(actions):
            sync: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if kind != "F":
                assert optimizer is not None, "a schedule with backward actions needs the optimizer"
                if i not in synced:  # DP reduction only in each chunk's last micro-batch
                    sync = optimizer.no_sync()
            if kind == "F":
                item = self._forward(i, micro, c, batches[micro], loss_scale / m, total, (micro, c) in split)
                if item is not None:  # evaluation runs forward-only under no_grad
                    live[(micro, c)] = item
                    self.peak_in_flight = max(self.peak_in_flight, len(live))
            elif kind == "B":
                assert optimizer is not None
                item = live[(micro, c)] if (micro, c) in split else live.pop((micro, c))
                defer = (optimizer.defer_weight_grads(item.wgrad) if item.wgrad is not None
                         else contextlib.nullcontext())
                with sync, defer:
                    self._backward(i, c, item)
            else:
                item = live.pop((micro, c))
                assert item.wgrad is not None, f"W{micro} of chunk {c} without a split B"
                with sync:
                    run_weight_grads(item.wgrad)
                ex.send(i, None, None)  # a W sends nothing, but posts the receives now due
        ex.finish()
        self._exchange = None
        return total

    def _forward(self, i: int, micro: int, c: int, batch: Batch, scale: float, total: torch.Tensor,
                 split: bool) -> _InFlight | None:
        vs, chunk = self.chunk_stages[c], self.chunks[c]
        first, last = vs == 0, vs == self.num_stages - 1
        ids, labels = (t.to(self.state.device) for t in batch)
        assert self._exchange is not None
        inp = None if first else self._exchange.receive(i)
        if inp is not None and torch.is_grad_enabled():
            inp.requires_grad_()
        wgrad = DeferredWeightGrads() if split and torch.is_grad_enabled() else None
        if isinstance(chunk, ScalesAuxLoss):  # MoE router losses are backpropagated with the loss's factor
            chunk.set_aux_loss_scale(scale)
        # Every chunk gets the ids: the first embeds them, document masking reads them on every stage.
        out = chunk(ids, labels if last else None, hidden=inp, dtype=self.dtype)
        if last:
            if self._divisor is None:
                loss = out.mean()
                total += loss.detach().double()
                out = loss * scale
            else:  # a token mean over the whole step: this micro-batch's share of it
                loss = out.sum() / self._divisor
                total += loss.detach().double()
                out = loss * self._loss_scale
            self._exchange.send(i, None, None)
        else:
            self._exchange.send(i, out.detach(), release=out)
        return _InFlight(inp, out, wgrad) if torch.is_grad_enabled() else None

    def _backward(self, i: int, c: int, item: _InFlight) -> None:
        """A whole backward, or a split one's B (the sync records the linears' W work)."""
        vs = self.chunk_stages[c]
        first, last = vs == 0, vs == self.num_stages - 1
        assert self._exchange is not None
        grad = torch.ones_like(item.out) if last else self._exchange.receive(i)
        # A sent output's storage is released to a one-element broadcast of its shape (`p2p`), so the
        # public backward's shape check holds while the memory is gone.
        # Its first call with gradient tensors imports torch.fx's symbolic shapes (sympy, mpmath: 480 modules); the
        # import above does that before the model is built, so their long-lived objects sit below it on the heap
        # and not in the holes step 1's freed activations leave (megalite/runtime/malloc.py).
        torch.autograd.backward(item.out, grad)
        input_grad = None if first else item.inp.grad  # type: ignore[union-attr]
        assert first or input_grad is not None
        self._exchange.send(i, input_grad, release=None)


def forward_only_schedule(num_micro: int, vpp: int) -> list[Action]:
    """Evaluation: every micro-batch through every chunk, in order (sends never block, so no deadlock)."""
    return [("F", m, c) for m in range(num_micro) for c in range(vpp)]
