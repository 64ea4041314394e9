"""Vocab-parallel cross-entropy: the loss over logits split along the vocabulary, never gathered.

Each TP rank holds logits for vocab columns [start, start + Vt). With m the row max, the loss of a
row with target t is  log(sum_j exp(z_j - m)) + m - z_t. Three all-reduces over TP of N floats each
(row max, sum of exponentials, target logit) replace a gather of N x V logits (Megatron-LM,
`vocab_parallel_cross_entropy`). Math in fp32 whatever the logits' dtype. Columns >= vocab_size
(padding) are masked to -inf: they never win the softmax and get zero gradient.
The backward is local: dz = (softmax(z) - onehot(t)) * dloss, optionally label-smoothed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.state import ParallelState


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, state: ParallelState,  # type: ignore[override]
                vocab_size: int, ignore_index: int, smoothing: float) -> torch.Tensor:
        vt = logits.shape[-1]
        start = state.tp_rank * vt
        z = logits.float()
        pad_cols = max(0, start + vt - vocab_size)
        if pad_cols:
            z = z.clone()
            z[:, vt - pad_cols:] = float("-inf")
        row_max = z.max(dim=-1).values
        comm.all_reduce(row_max, state, "tp", op=dist.ReduceOp.MAX)
        z = z - row_max.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < vt) & (target != ignore_index)
        safe_t = local_t.clamp(0, vt - 1)
        target_logit = torch.where(in_shard, z.gather(1, safe_t.unsqueeze(1)).squeeze(1), 0.0)
        # sum_exp and the target logit share one all-reduce (2N floats): fewer launches, same bytes.
        packed = torch.stack([sum_exp, target_logit])
        comm.all_reduce(packed, state, "tp")
        sum_exp, target_logit = packed[0], packed[1]
        log_z = sum_exp.log()
        loss = log_z - target_logit
        if smoothing > 0.0:
            # Smoothed target: (1-eps) onehot + eps/V uniform over the real vocabulary.
            real = torch.isfinite(z)
            sum_z = torch.where(real, z, 0.0).sum(dim=-1)
            comm.all_reduce(sum_z, state, "tp")
            loss = (1 - smoothing) * loss + smoothing * (log_z - sum_z / vocab_size)
        valid = target != ignore_index
        loss = torch.where(valid, loss, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe_t, in_shard, valid)
        ctx.smoothing, ctx.vocab_size, ctx.dtype, ctx.pad_cols = smoothing, vocab_size, logits.dtype, pad_cols
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, safe_t, in_shard, valid = ctx.saved_tensors
        grad = softmax
        eps = ctx.smoothing
        onehot_weight = (1.0 - eps) * in_shard.float()
        grad.scatter_add_(1, safe_t.unsqueeze(1), -onehot_weight.unsqueeze(1))
        if eps > 0.0:
            uniform = torch.full_like(grad, eps / ctx.vocab_size)
            if ctx.pad_cols:
                uniform[:, grad.shape[1] - ctx.pad_cols:] = 0.0
            grad = grad - uniform
        grad = grad * (grad_loss * valid.float()).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, state: ParallelState,
                                 vocab_size: int, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [N] (fp32, 0 at ignored rows) from this rank's logit columns [N, V/tp]."""
    if state.tp == 1:
        # One rank holds the whole vocabulary: torch's fused kernel on the real columns (a view; the
        # padding columns get no gradient) is several passes over the logits cheaper than the general form.
        real = logits[:, :vocab_size]
        return F.cross_entropy(real.float(), target, reduction="none", ignore_index=ignore_index,
                               label_smoothing=label_smoothing)
    return _VocabParallelCE.apply(logits, target, state, vocab_size, ignore_index, label_smoothing)
