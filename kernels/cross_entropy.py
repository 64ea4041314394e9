"""Cross-entropy with an online softmax over the vocabulary, plus its vocab-parallel form.

Memory is what matters here: logits are [tokens, vocab] (e.g. 8K x 128K = 2 GiB in bf16), and the
eager recipe `F.cross_entropy(logits.float())` adds an fp32 copy, a softmax and a gradient of the
same size. Following Liger-Kernel (Hsu et al. 2024), one program per row:
  1. streams the row in blocks keeping a running max m and sum d = sum exp(x - m) in fp32
     (the online softmax of Milakov & Gimelshein 2018), so nothing of size V is materialised;
  2. loss = log(d) + m - x[target]  (0 for rows whose target is ignore_index);
  3. if the logits need a gradient, streams the row again and overwrites it *in place* with
     softmax(x) - onehot(target): the gradient needs no new [N, V] buffer. Backward only scales
     each row by grad_output (fp32 math). The logits tensor is therefore consumed: its version
     counter is bumped, so autograd raises if anything else saved it for backward.
Vocab-parallel (Megatron-LM, Shoeybi et al. 2019): each tensor-parallel rank holds the columns
[vocab_start, vocab_start + Vt). The local pass gives (local max, local sum-exp, target logit or 0);
the max is all-reduced, the local sums are rescaled to the global max, (sum-exp, target logit) are
all-reduced together in one call, then the same gradient pass runs on the shard.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._triton import interpreting, jit, next_power_of_2, tl  # lazy stand-ins (see _triton.py)

AllReduce = Callable[[torch.Tensor], None]


@jit
def _row_stats(x_row, V, BLOCK_V: tl.constexpr):
    """Online softmax statistics of one row: (max m, sum exp(x - m)), fp32."""
    m = -float("inf")
    d = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, d


@jit
def _write_grad(x_row, V, m, d, t_local, zero_row, BLOCK_V: tl.constexpr):
    """Overwrite the row with softmax - onehot(t_local) (t_local may fall outside [0, V))."""
    inv_d = 1.0 / d
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - m) * inv_d - tl.where(cols == t_local, 1.0, 0.0)
        g = tl.where(zero_row, 0.0, g)
        tl.store(x_row + cols, g.to(x_row.dtype.element_ty), mask=mask)


@jit
def _ce_fwd_kernel(X, T, LOSS, stride_x, V, ignore_index, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row)
    ignored = t == ignore_index
    m, d = _row_stats(x_row, V, BLOCK_V)
    x_t = tl.load(x_row + t, mask=(t >= 0) & (t < V) & (~ignored), other=0.0).to(tl.float32)
    loss = tl.where(ignored, 0.0, tl.log(d) + m - x_t)
    tl.store(LOSS + row, loss)
    if WRITE_GRAD:
        _write_grad(x_row, V, m, d, t, ignored, BLOCK_V)


@jit
def _vp_stats_kernel(X, T, M, D, XT, stride_x, V, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row) - vocab_start
    m, d = _row_stats(x_row, V, BLOCK_V)
    x_t = tl.load(x_row + t, mask=(t >= 0) & (t < V), other=0.0).to(tl.float32)
    tl.store(M + row, m)
    tl.store(D + row, d)
    tl.store(XT + row, x_t)


@jit
def _vp_grad_kernel(X, T, M, D, stride_x, V, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row)
    _write_grad(X + row * stride_x, V, tl.load(M + row), tl.load(D + row), t - vocab_start,
                t == ignore_index, BLOCK_V)


@jit
def _scale_rows_kernel(X, GO, stride_x, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    go = tl.load(GO + row).to(tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_row + cols, (g * go).to(x_row.dtype.element_ty), mask=mask)


def _blocks(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps). Tiny blocks under the interpreter so tests cover multi-block rows."""
    if interpreting():
        return min(64, next_power_of_2(V)), 1
    block = min(8192, next_power_of_2(V))
    return block, 16 if block >= 8192 else 8


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() != 2 or target.shape != logits.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"cross_entropy: need logits [N, V] and int64 target [N], got "
                         f"{tuple(logits.shape)} and {tuple(target.shape)} {target.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy: logits must have a unit last stride (the gradient is written in place)")


class _GradInLogits(torch.autograd.Function):
    """Shared backward: the gradient already sits in the logits buffer; scale rows by grad_output."""

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        buf = ctx.grad_buf
        if buf is None:
            raise RuntimeError("cross_entropy backward ran twice: the gradient lives in the logits buffer "
                               "and is consumed by the first backward (do not use retain_graph here)")
        ctx.grad_buf = None
        block, warps = _blocks(buf.shape[1])
        _scale_rows_kernel[(buf.shape[0],)](buf, grad_loss.contiguous(), buf.stride(0), buf.shape[1],
                                            BLOCK_V=block, num_warps=warps)
        return (buf,) + (None,) * ctx.n_other_args


class _CrossEntropy(_GradInLogits):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:  # type: ignore[override]
        N, V = logits.shape
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        write_grad = logits.requires_grad
        block, warps = _blocks(V)
        _ce_fwd_kernel[(N,)](logits, target, loss, logits.stride(0), V, ignore_index,
                             WRITE_GRAD=write_grad, BLOCK_V=block, num_warps=warps)
        if write_grad:
            torch.autograd.graph.increment_version(logits)
        ctx.grad_buf = logits if write_grad else None
        ctx.n_other_args = 2
        return loss


class _VocabParallelCrossEntropy(_GradInLogits):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
        all_reduce_max: AllReduce, all_reduce_sum: AllReduce, ignore_index: int,
    ) -> torch.Tensor:
        N, V = logits.shape
        f32: dict[str, Any] = dict(dtype=torch.float32, device=logits.device)
        m_local, d_local, stats = torch.empty(N, **f32), torch.empty(N, **f32), torch.empty(2, N, **f32)
        block, warps = _blocks(V)
        # Pass 1 (local): max, sum-exp relative to the local max, and the target logit (0 off-shard).
        _vp_stats_kernel[(N,)](logits, target, m_local, d_local, stats[1], logits.stride(0), V,
                               vocab_start, ignore_index, BLOCK_V=block, num_warps=warps)
        m = m_local.clone()
        all_reduce_max(m)
        # Rescale to the global max: sum exp(x - m) = exp(m_local - m) * sum exp(x - m_local). This is
        # what a second pass over the shard would give, without reading the logits again.
        torch.mul(d_local, torch.exp(m_local - m), out=stats[0])
        all_reduce_sum(stats)  # one collective for (sum-exp, target logit)
        d, x_t = stats[0], stats[1]
        loss = torch.where(target == ignore_index, 0.0, torch.log(d) + m - x_t)
        write_grad = logits.requires_grad
        if write_grad:
            _vp_grad_kernel[(N,)](logits, target, m, d, logits.stride(0), V, vocab_start, ignore_index,
                                  BLOCK_V=block, num_warps=warps)
            torch.autograd.graph.increment_version(logits)
        ctx.grad_buf = logits if write_grad else None
        ctx.n_other_args = 5
        return loss


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-row loss [N] fp32 (0 where target == ignore_index). Overwrites `logits` with its gradient
    when it requires grad: do not reuse the logits after calling this."""
    _check(logits, target)
    return _CrossEntropy.apply(logits, target.contiguous(), ignore_index)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
    all_reduce_max: AllReduce, all_reduce_sum: AllReduce, ignore_index: int = -100,
) -> torch.Tensor:
    """Per-row loss [N] fp32 over a vocab shard holding global columns [vocab_start, vocab_start+Vt).
    The callables all-reduce a tensor in place across the tensor-parallel group (MAX, SUM); with
    identity callables this equals `cross_entropy`. Overwrites the shard with its gradient."""
    _check(logits_shard, target)
    return _VocabParallelCrossEntropy.apply(logits_shard, target.contiguous(), vocab_start,
                                            all_reduce_max, all_reduce_sum, ignore_index)


# ---- plain-torch references ----

def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy in fp32, per row (0 at ignored rows)."""
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")


class _VocabParallelReference(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy in plain torch (fp32 copy of the shard and all)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
        all_reduce_max: AllReduce, all_reduce_sum: AllReduce, ignore_index: int,
    ) -> torch.Tensor:
        x = logits.float()
        V = x.shape[1]
        m = x.max(dim=1).values
        all_reduce_max(m)
        e = torch.exp(x - m[:, None])
        local_t = target - vocab_start
        on_shard = (local_t >= 0) & (local_t < V)
        idx = torch.where(on_shard, local_t, 0)
        stats = torch.stack([e.sum(dim=1), torch.where(on_shard, x.gather(1, idx[:, None])[:, 0], 0.0)])
        all_reduce_sum(stats)
        ignored = target == ignore_index
        loss = torch.where(ignored, 0.0, torch.log(stats[0]) + m - stats[1])
        ctx.save_for_backward(e / stats[0][:, None], idx, on_shard & ~ignored, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        softmax, idx, hit, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, idx[:, None], -hit.float()[:, None])
        grad = torch.where(ignored[:, None], 0.0, grad) * grad_loss[:, None]
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy_reference(
    logits_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
    all_reduce_max: AllReduce, all_reduce_sum: AllReduce, ignore_index: int = -100,
) -> torch.Tensor:
    """Same signature and result as `vocab_parallel_cross_entropy`, in plain torch (no in-place)."""
    return _VocabParallelReference.apply(logits_shard, target, vocab_start, all_reduce_max,
                                         all_reduce_sum, ignore_index)
