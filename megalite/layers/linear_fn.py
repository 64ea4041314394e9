"""The autograd function under megalite's linear layers: y_i = x W_i^T (+ b_i) for the row blocks W_i
of one weight, with the weight gradient optionally added straight into the optimizer's fp32 buffer.

Why one matmul per part: a fused QKV or gate/up weight is one parameter (one TP layout, one
checkpoint tensor), but computed as one matmul it yields one [N, sum(out)] output whose q/k/v or
gate/up are strided column slices: elementwise ops on them are slower (SwiGLU on a strided half takes
~1.4x as long on CPU), and the split's backward concatenates the parts' gradients into a new tensor.
One matmul per part writes each output contiguous and reads each gradient where it lies; the
matmuls are the same FLOPs (Hugging Face's separate q/k/v/gate/up layers do the same).

Why the weight gradient bypasses autograd (Megatron-LM's `gradient_accumulation_fusion`): the
gradient sync keeps fp32 gradients in flat buffers. The usual path materialises dW, stores it in
`.grad`, and a Python hook adds it to the buffer and drops it. When the caller passes a `fold` (the
linear layers pass the one the gradient sync registered with them, for weights used by one linear
only), backward instead hands it a function that accumulates dW into the fp32 buffer view it is given:
`addmm_` (the add happens inside the GEMM) when the activations are fp32, `add_` of the matmul
otherwise (the same rounding as the hook path). Autograd then sees no weight gradient at all.

The fold decides *when* that function runs. Normally at once; for the zero-bubble pipeline schedules
(Qi et al. 2024) the gradient sync records it in a `DeferredWeightGrads` during a micro-batch's
input-gradient backward "B", and the schedule's "W" action runs the recorded work later with
`DeferredWeightGrads.run()`, a plain call, in the same order and through the same `_accumulate_wgrad`,
so the fp32 main grad is bitwise what the undeferred backward gives. Until W runs, each recorded call
holds the linear's saved input ([tokens, in], which forward already kept) and the gradients of its
outputs ([tokens, out] per part). A linear without a fold computes dW in its backward, as autograd does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

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
class DeferredWeightGrads:
    """The weight-gradient work of one micro-batch's backward through one model chunk, recorded by a
    fold during B and run by W (see the module doc for what it holds)."""

    work: list[Callable[[], None]] = field(default_factory=list)

    def add(self, fn: Callable[[], None]) -> None:
        self.work.append(fn)

    def run(self) -> None:
        """Run the recorded work in recording order and release what it held. Outside autograd (as a
        backward runs it): the held activations require grad, the sums must not record a graph."""
        work, self.work = self.work, []
        with torch.no_grad():
            for fn in work:
                fn()


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
            if fold is not None:  # now, or in a zero-bubble W (the fold decides)
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


class Gemms(Protocol):
    """The matmuls a parallel linear calls: this module's `linear_parts` / `linear` by default (`TORCH_GEMMS`),
    or another implementation with the same arguments and outputs (FP8: `megalite.fp8.linear.Fp8Gemm`)."""

    def linear_parts(self, x: Tensor, weight: Tensor, bias: Tensor | None, blocks: Blocks,
                     fold: Fold | None = None) -> tuple[Tensor, ...]: ...

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, fold: Fold | None = None) -> Tensor: ...


class _TorchGemms:
    """This module's functions as `Gemms` (static: a linear's call reaches them with no extra frame)."""

    linear_parts = staticmethod(linear_parts)
    linear = staticmethod(linear)


TORCH_GEMMS: Gemms = _TorchGemms()


@runtime_checkable
class TakesGemms(Protocol):
    """A layer whose matmuls can be swapped (`megalite.fp8.enable.enable_fp8` gives it FP8 GEMMs)."""

    def set_gemms(self, gemms: Gemms | None) -> None: ...
