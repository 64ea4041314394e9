"""One optimizer step: forward/backward over the micro-batches, reduce, clip, update.

Gradient accumulation: each micro-batch's mean token loss is divided by the number of micro-batches
M, so the accumulated gradient is that of the mean loss over the global batch (every micro-batch
has the same token count in pretraining). The DP average is taken in `reduce_gradients`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from megalite.optim.adamw import LossScaler
from megalite.optim.distributed import DataParallelOptimizer
from megalite.optim.schedule import lr_at
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: float          # mean token loss over the global batch (all DP ranks)
    grad_norm: float     # global norm before clipping (inf/nan when the step was skipped)
    lr: float
    skipped: bool


def train_step(model: nn.Module, optimizer: DataParallelOptimizer, batches: list[Batch], state: ParallelState,
               tcfg, step: int, dtype: torch.dtype, scaler: LossScaler) -> StepResult:
    """Run one step over this rank's micro-batches; every rank returns the same StepResult."""
    model.train()
    lr = lr_at(step, tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.steps)
    optimizer.zero_grad()
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    m = len(batches)
    for i, (ids, labels) in enumerate(batches):
        ids, labels = ids.to(state.device), labels.to(state.device)
        # Only the last micro-batch's backward may communicate (DP reduction once per step).
        with optimizer.no_sync() if i < m - 1 else contextlib.nullcontext():
            loss = model(ids, labels, dtype=dtype).mean()
            (loss * (scaler.scale / m)).backward()
        total += loss.detach().double()
    optimizer.finish_grad_sync()
    if scaler.enabled:
        optimizer.scale_grads(1.0 / scaler.scale)
    norm = optimizer.grad_norm()  # agreed by every rank: summed over tp x pp, equal over dp
    skipped = not math.isfinite(norm)
    scaler.update(found_inf=skipped)
    if not skipped:
        optimizer.step(lr, tcfg.clip_grad, norm)
    total /= m
    comm.all_reduce(total, state, "dp", count_as="metrics")
    return StepResult(loss=total.item() / state.dp, grad_norm=norm, lr=lr, skipped=skipped)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], state: ParallelState, dtype: torch.dtype) -> float:
    """Mean token loss over the given micro-batches, averaged over DP ranks."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    for ids, labels in batches:
        total += model(ids.to(state.device), labels.to(state.device), dtype=dtype).mean().double()
    total /= max(1, len(batches))
    comm.all_reduce(total, state, "dp", count_as="metrics")
    return total.item() / state.dp
