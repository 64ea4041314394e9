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
`.grad`, and a Python hook adds it to the buffer and drops it. When the optimizer has given the
weight a `fold_main_grad` callable (`ZeroOptimizer` does, for weights used by exactly one linear),
backward instead passes it a function that accumulates dW into the fp32 buffer view it is handed:
`addmm_` (the add happens inside the GEMM) when the activations are fp32, `add_` of the matmul
otherwise (the same rounding as the hook path). Autograd then sees no weight gradient at all.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor
Fold = Callable[[Callable[[Tensor], None]], None]


def _blocks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def _accumulate_wgrad(main: Tensor, grads: list[Tensor], x2: Tensor, sizes: Sequence[int]) -> None:
    """main[rows of part i] += g_i^T x for every part (main is the fp32 [out, in] gradient view)."""
    for g, (lo, hi) in zip(grads, _blocks(sizes)):
        if main.dtype == x2.dtype:
            main[lo:hi].addmm_(g.t(), x2)
        else:
            main[lo:hi].add_(torch.mm(g.t(), x2))


class LinearParts(torch.autograd.Function):
    """Forward: x [..., in], weight [sum(sizes), in], bias [sum(sizes)] or None -> one [..., n_i] per part."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        outs = []
        for lo, hi in _blocks(sizes):
            if bias is None:
                y = torch.mm(x2, w[lo:hi].t())
            else:
                y = torch.addmm(bias[lo:hi].to(x.dtype), x2, w[lo:hi].t())
            outs.append(y.view(*x.shape[:-1], hi - lo))
        ctx.save_for_backward(x2, weight)
        ctx.sizes, ctx.x_shape = sizes, x.shape
        # Read now, from the parameter itself: under activation checkpointing the saved `weight` comes
        # back in backward as a recomputed alias without the attribute.
        ctx.fold = getattr(weight, "fold_main_grad", None)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        sizes = ctx.sizes
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # first: a ZeRO-3 fold below may free the weight's storage
            w = weight if weight.dtype == x2.dtype else weight.to(x2.dtype)
            for g, (lo, hi) in zip(gs, _blocks(sizes)):
                if dx is None:
                    dx = torch.mm(g, w[lo:hi])
                else:
                    dx.addmm_(g, w[lo:hi])
            assert dx is not None
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[2]:
            db = torch.cat([g.sum(0) for g in gs]).to(ctx.bias_dtype)
        if ctx.needs_input_grad[1]:
            fold: Fold | None = ctx.fold
            if fold is not None:
                fold(lambda main: _accumulate_wgrad(main, gs, x2, sizes))
            else:
                dw = torch.empty(weight.shape, dtype=x2.dtype, device=x2.device)
                for g, (lo, hi) in zip(gs, _blocks(sizes)):
                    torch.mm(g.t(), x2, out=dw[lo:hi])
                dw = dw.to(weight.dtype)
        return dx, dw, db, None


def linear_parts(x: Tensor, weight: Tensor, bias: Tensor | None, sizes: Sequence[int]) -> tuple[Tensor, ...]:
    """One output per row block of `weight` (sizes sum to weight.shape[0]); see the module doc."""
    if sum(sizes) != weight.shape[0]:
        raise ValueError(f"part sizes {list(sizes)} do not add up to the weight's {weight.shape[0]} rows")
    return LinearParts.apply(x, weight, bias, tuple(sizes))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear with the main-grad fold (a single part)."""
    return linear_parts(x, weight, bias, (weight.shape[0],))[0]
