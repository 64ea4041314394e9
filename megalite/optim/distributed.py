"""The optimizer interface the training step talks to, and its plain data-parallel form (zero=0).

A step is: `zero_grad()`; forward/backward over the micro-batches, all but the last backward
inside `no_sync()` (gradients accumulate locally); `finish_grad_sync()` (gradients are reduced over
DP exactly once per step); `grad_norm()` (global, each parameter once); `step(lr, clip, norm)`.
ZeRO stages implement the same interface (`megalite.optim.zero`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from megalite.optim.adamw import build_optimizer
from megalite.optim.grads import clip_gradients, global_grad_norm, reduce_gradients, unique_params
from megalite.parallel.state import ParallelState


class DataParallelOptimizer:
    """Replicated AdamW; after the last micro-batch the gradients are all-reduced over DP."""

    def __init__(self, model: nn.Module, state: ParallelState, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float) -> None:
        self.model, self.state = model, state
        self.optimizer = build_optimizer(model, lr, weight_decay, betas, eps)
        self._sync = True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish_grad_sync(self) -> None:
        reduce_gradients(self.model, self.state)

    def scale_grads(self, factor: float) -> None:
        for p in unique_params(self.model):
            if p.grad is not None:
                p.grad.mul_(factor)

    def grad_norm(self) -> float:
        return global_grad_norm(self.model, self.state)

    def step(self, lr: float, clip: float, norm: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clip_gradients(self.model, clip, norm)
        self.optimizer.step()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.optimizer.load_state_dict(d)

    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds, by kind (counted from tensors, not the allocator)."""
        params = unique_params(self.model)
        out = {"params": sum(p.numel() * p.element_size() for p in params),
               "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
               "master": 0, "optimizer": 0}
        for s in self.optimizer.state.values():
            out["optimizer"] += sum(t.numel() * t.element_size() for t in s.values()
                                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        return out
