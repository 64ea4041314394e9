"""The reference optimizer: replicated AdamW over plain `.grad` tensors, the oracle tests compare against.

Production always uses `ZeroOptimizer` (`megalite.optim.zero`, a gradient sync + AdamW on its shards, every
ZeRO stage); this one implements
the same `DistributedOptimizer` protocol (`megalite.optim.protocol`) in the most direct way —
`torch.optim.AdamW` on the model's parameters, one flat DP all-reduce after the last micro-batch,
the global norm over `.grad` — so that the ZeRO stages, the pipeline and the checkpoints can be
checked against it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from megalite.dp.reduce_grads import reduce_gradients, sync_tied_embeddings, unique_params
from megalite.errors import ConfigError
from megalite.layers.linear_fn import DeferredWeightGrads
from megalite.optim.clip import clip_grads, global_norm, param_pieces
from megalite.parallel.param_spec import logical_name, spec_table
from megalite.parallel.state import ParallelState


def adamw_with_groups(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                      eps: float) -> torch.optim.AdamW:
    """torch's AdamW with the usual GPT parameter groups: weight decay on matrices only; norms, biases and
    (1-D) gains are not decayed (GPT-2/Megatron; `Segment.decay` is the same rule on shards)."""
    params = unique_params(model)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the same per-tensor arithmetic at any layout, so TP parity holds to round-off.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


class ReferenceOptimizer:
    """Replicated AdamW; after the last micro-batch the gradients are all-reduced over DP."""

    stage = 0  # nothing is sharded over dp (ZeRO stage 0)

    def __init__(self, model: nn.Module, state: ParallelState, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float) -> None:
        self.model, self.state = model, state
        self.specs = spec_table(model, ConfigError)
        self.optimizer = adamw_with_groups(model, lr, weight_decay, betas, eps)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing communicates during a backward here (the reduction is all in `finish_grad_sync`)."""
        yield

    @contextlib.contextmanager
    def defer_weight_grads(self, store: DeferredWeightGrads) -> Iterator[None]:
        """The linears get no fold here, so nothing is deferred: B computes the weight gradients, W is empty."""
        yield

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Parameters are always whole here (the ZeRO-3 optimizer gathers them)."""
        yield

    def finish_param_sync(self) -> None:
        """Nothing is ever in flight here: the parameters are updated in place."""

    def finish_grad_sync(self) -> None:
        reduce_gradients(self.model, self.state, self.specs)
        sync_tied_embeddings(self.model, self.state, self.specs)

    def scale_grads(self, factor: float) -> None:
        for p in unique_params(self.model):
            if p.grad is not None:
                p.grad.mul_(factor)

    def grad_norm(self) -> float:
        return global_norm(param_pieces(unique_params(self.model), self.specs, self.state), self.state)

    def step(self, lr: float, clip: float, norm: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clip_grads([p.grad for p in unique_params(self.model) if p.grad is not None], clip, norm)
        self.optimizer.step()

    def _named_params(self) -> dict[str, nn.Parameter]:
        """Global parameter names (the "0." / "1." chunk prefix of an nn.ModuleList dropped), each once."""
        out: dict[str, nn.Parameter] = {}
        for name, p in self.model.named_parameters():
            out.setdefault(logical_name(name), p)
        return out

    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """The checkpoint half of the protocol (`megalite.checkpoint.sharded`): global name -> {"exp_avg", "exp_avg_sq"}
        shaped like the local TP shard, plus "step"; params without state yet (before the first step) are
        left out. Replicated here, so nothing to gather; the ZeRO optimizers gather over dp inside."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self._named_params().items():
            s = self.optimizer.state.get(p)
            if s and "exp_avg" in s:
                out[name] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"],
                             "step": torch.as_tensor(s["step"], dtype=torch.float32).detach().cpu()}
        return out

    def load_param_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of `param_states`. An entry without "exp_avg" (or a param missing from `states`) starts fresh,
        as torch's AdamW does for a param it has not seen; "master" is ignored: the params are the fp32 truth
        here, and the checkpoint loader has already copied them in."""
        for name, p in self._named_params().items():
            entry = states.get(name, {})
            if "exp_avg" not in entry:
                self.optimizer.state.pop(p, None)
                continue
            self.optimizer.state[p] = {
                "step": torch.tensor(float(entry["step"]), dtype=torch.float32),
                "exp_avg": entry["exp_avg"].to(p.device, p.dtype).clone(),
                "exp_avg_sq": entry["exp_avg_sq"].to(p.device, p.dtype).clone()}

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
