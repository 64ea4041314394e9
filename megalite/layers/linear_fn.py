"""The autograd function under megalite's linear layers: y_i = x W_i^T (+ b_i) for the row blocks W_i
of one weight, with the weight gradient optionally added straight into the optimizer's fp32 buffer.

Why one matmul per part: a fused QKV or gate/up weight is one parameter (one TP layout, one
checkpoint tensor), but computed as one matmul it yields one [N, sum(out)] output whose q/k/v or
gate/up are strided column slices: elementwise ops on them are slower (SwiGLU on a strided half takes
~1.4x as long on CPU), and the split's backward concatenates the parts' gradients into a new tensor.
One matmul per part writes each output contiguous and reads each gradient where it lies; the
matmuls are the same FLOPs (Hugging Face's separate q/k/v/gate/up layers do the same).

Why the weight gradient bypasses autograd (Megatron-LM's `gradient_accumulation_fusion`): the
ZeRO optimizer keeps fp32 gradients in flat buffers. The usual path materialises dW, stores it in
`.grad`, and a Python hook adds it to the buffer and drops it. When the caller passes a `fold` (the
linear layers pass the one `ZeroOptimizer` registered with them, for weights used by one linear only),
backward instead passes it a function that accumulates dW into the fp32 buffer view it is handed:
`addmm_` (the add happens inside the GEMM) when the activations are fp32, `add_` of the matmul
otherwise (the same rounding as the hook path). Autograd then sees no weight gradient at all.

Deferred weight gradients (zero-bubble pipeline schedules, Qi et al. 2024): while a
`DeferredWeightGrads` is active (`defer_weight_grads`, entered by the pipeline engine around a
micro-batch's forward and its input-gradient backward "B"), each linear's backward computes only dx
and records its weight-gradient work instead; the schedule's "W" action runs it later
(`run_weight_grads`), in the same order, through the same `_accumulate_wgrad`, so the fp32 main grad
is bitwise what the undeferred backward gives. A deferred W holds, per linear call: the linear's
saved input (the [tokens, in] activation that forward already kept) and the gradients of its
outputs ([tokens, out] per part), until the W runs. The layer picks the active store up in forward
(where the caller's context is visible; backward may run on autograd's device threads). Under
activation recompute the recomputed forward runs inside B: on CPU it sees the store the engine
activates around B and records; on a device thread (CUDA) it sees none, and those linears compute
their weight gradient in B as usual (still exact, just not deferred).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor
Fold = Callable[[Callable[[Tensor], None]], None]
Blocks = tuple[tuple[int, int], ...]  # each part's rows [lo, hi) of the weight


def part_blocks(sizes: Sequence[int]) -> Blocks:
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return tuple(out)


def _rows(w: Tensor, lo: int, hi: int) -> Tensor:
    return w if lo == 0 and hi == w.shape[0] else w[lo:hi]


def _accumulate_wgrad(main: Tensor, grads: list[Tensor], x2: Tensor, blocks: Blocks) -> None:
    """main[rows of part i] += g_i^T x for every part (main is the fp32 [out, in] gradient view)."""
    for g, (lo, hi) in zip(grads, blocks):
        if main.dtype == x2.dtype:
            _rows(main, lo, hi).addmm_(g.t(), x2)
        else:
            _rows(main, lo, hi).add_(torch.mm(g.t(), x2))


@dataclass
class _WeightGradWork:
    weight: Tensor
    fold: Fold | None
    x2: Tensor                # the linear's input, [tokens, in]
    grads: list[Tensor]       # the gradient of each part's output, [tokens, part rows]
    blocks: Blocks


@dataclass
class DeferredWeightGrads:
    """The weight-gradient work of one micro-batch's backward through one model chunk, recorded by
    the linears during B and run by W (see the module doc for what it holds)."""

    work: list[_WeightGradWork] = field(default_factory=list)

    def compute(self) -> list[tuple[Tensor, Tensor | None]]:
        """Run the recorded work in recording order: a folded weight's gradient goes into the
        optimizer's main grad (None returned for it), any other weight's dW is returned. Releases the
        held tensors."""
        out: list[tuple[Tensor, Tensor | None]] = []
        for w in self.work:
            if w.fold is not None:
                w.fold(functools.partial(_accumulate_wgrad, grads=w.grads, x2=w.x2, blocks=w.blocks))
                out.append((w.weight, None))
            else:
                out.append((w.weight, _weight_grad(w.weight, w.grads, w.x2, w.blocks)))
        self.work = []
        return out


_ACTIVE: contextvars.ContextVar[DeferredWeightGrads | None] = contextvars.ContextVar("deferred_wgrad", default=None)


@contextlib.contextmanager
def defer_weight_grads(store: DeferredWeightGrads | None) -> Iterator[None]:
    """Linears run forward inside this record their weight-gradient work into `store` in backward
    (None: compute it in backward as usual)."""
    token = _ACTIVE.set(store)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _WeightGradPass(torch.autograd.Function):
    """A one-node graph whose backward runs a W: folds happen, and other gradients reach their
    parameters through autograd's own accumulation (and the optimizer's hooks), inside a backward
    pass, exactly as they would in an undeferred backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[], list[Tensor | None]], *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.run = run
        return torch.zeros((), device=params[0].device)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.run())


def run_weight_grads(store: DeferredWeightGrads, held: Sequence[tuple[Tensor, Tensor]] = ()) -> None:
    """The W action: run `store`'s work and deliver `held` (parameter, gradient) pairs computed
    earlier, all in one backward pass (so an optimizer that counts a bucket's gradients per backward
    sees all of them there)."""
    params: list[Tensor] = []
    index: dict[int, int] = {}
    for p in [w.weight for w in store.work] + [p for p, _ in held]:
        if id(p) not in index:
            index[id(p)] = len(params)
            params.append(p)
    if not params:
        return

    def run() -> list[Tensor | None]:
        grads: list[Tensor | None] = [None] * len(params)
        for p, g in list(held) + store.compute():
            if g is not None:
                i = index[id(p)]
                grads[i] = g if grads[i] is None else grads[i] + g  # type: ignore[operator]
        return grads

    with torch.enable_grad():
        _WeightGradPass.apply(run, *params).backward()


def _weight_grad(weight: Tensor, grads: list[Tensor], x2: Tensor, blocks: Blocks) -> Tensor:
    """dW = g^T x for every part, in the weight's dtype."""
    if len(grads) == 1:
        return torch.mm(grads[0].t(), x2).to(weight.dtype)
    dw = torch.empty(weight.shape, dtype=x2.dtype, device=x2.device)
    for g, (lo, hi) in zip(grads, blocks):
        torch.mm(g.t(), x2, out=dw[lo:hi])
    return dw.to(weight.dtype)


class LinearParts(torch.autograd.Function):
    """Forward: x [..., in], weight [out, in], bias [out] or None -> one [..., hi - lo] per row block.

    Kept lean (it runs for every linear of every micro-batch, and on a GPU small layers are bound by
    this Python): one part takes the plain path, blocks are computed once by the caller."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                blocks: Blocks, fold: Fold | None) -> tuple[Tensor, ...]:
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        b = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        outs = []
        for lo, hi in blocks:
            wi = _rows(w, lo, hi).t()
            y = torch.mm(x2, wi) if b is None else torch.addmm(_rows(b, lo, hi), x2, wi)
            outs.append(y.view(*lead, hi - lo))
        ctx.save_for_backward(x2, weight)
        ctx.blocks, ctx.x_shape = blocks, x.shape
        ctx.fold = fold
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.deferred = _ACTIVE.get()
        # The parameter itself, for a deferred W to deliver its gradient to (not the saved alias).
        ctx.param = weight if ctx.deferred is not None else None
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        blocks: Blocks = ctx.blocks
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]
        dx = dw = db = None
        if need_x:  # first: a ZeRO-3 fold below may free the weight's storage
            w = weight if weight.dtype == x2.dtype else weight.to(x2.dtype)
            for g, (lo, hi) in zip(gs, blocks):
                if dx is None:
                    dx = torch.mm(g, _rows(w, lo, hi))
                else:
                    dx.addmm_(g, _rows(w, lo, hi))
            dx = dx.view(ctx.x_shape)  # type: ignore[union-attr]
        if need_b:
            db = (gs[0].sum(0) if len(gs) == 1 else torch.cat([g.sum(0) for g in gs])).to(ctx.bias_dtype)
        if need_w:
            fold: Fold | None = ctx.fold
            deferred: DeferredWeightGrads | None = ctx.deferred
            if deferred is not None:  # a zero-bubble "B": the schedule's "W" computes it later
                deferred.work.append(_WeightGradWork(ctx.param, fold, x2, gs, blocks))
            elif fold is not None:
                fold(lambda main: _accumulate_wgrad(main, gs, x2, blocks))
            else:
                dw = _weight_grad(weight, gs, x2, blocks)
        return dx, dw, db, None, None


def linear_parts(x: Tensor, weight: Tensor, bias: Tensor | None, blocks: Blocks,
                 fold: Fold | None = None) -> tuple[Tensor, ...]:
    """One output per row block of `weight` (`part_blocks(sizes)`); see the module doc."""
    if blocks[-1][1] != weight.shape[0]:
        raise ValueError(f"part blocks {list(blocks)} do not cover the weight's {weight.shape[0]} rows")
    return LinearParts.apply(x, weight, bias, blocks, fold)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, fold: Fold | None = None) -> Tensor:
    """F.linear with the main-grad fold (a single part)."""
    return LinearParts.apply(x, weight, bias, ((0, weight.shape[0]),), fold)[0]
