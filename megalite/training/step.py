"""One optimizer step: forward/backward over the micro-batches, reduce, clip, update.

Gradient accumulation: each micro-batch's mean token loss is divided by the number of micro-batches
M, so the accumulated gradient is that of the mean loss over the global batch (every micro-batch
has the same token count in pretraining). The DP average is taken by the optimizer's gradient reduction.

Context parallelism: each cp rank's loss is the mean over its S/cp tokens of each sequence, so its
gradient is cp times its share of the sequence's; the optimizer sums the gradients over dp x cp and divides
by dp x cp (each parameter's `ParamSpec.grad_group`), which gives the single-process gradient.

A global token mean (`StepContext.global_token_mean`, SFT: labels of -100 are not counted): the loss is the
sum of every counted token loss of the step, over all micro-batches and ranks, divided once by their number
N, never a mean of per-micro-batch means (which would weigh a micro-batch with few assistant tokens as much
as one with many, and change with dp and gradient accumulation). N is summed over dp x cp first (one
all-reduce of one number); each micro-batch then backpropagates its token-loss sum / (N / (dp x cp)), and the
gradient reduction's division by dp x cp makes that sum / N exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from megalite.moe.balance import update_router_biases
from megalite.moe.step_metrics import moe_step_metrics
from megalite.mtp.metrics import mtp_step_metrics
from megalite.optim.loss_scale import LossScaler
from megalite.optim.protocol import DistributedOptimizer
from megalite.optim.schedule import lr_at
from megalite.parallel import comm
from megalite.parallel.state import ParallelState
from megalite.pipeline.engine import PipelineEngine, forward_only_schedule
from megalite.pipeline.schedules import build_schedule

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: float          # mean token loss over the global batch (all DP ranks)
    grad_norm: float     # global norm before clipping (inf/nan when the step was skipped)
    lr: float
    skipped: bool
    moe: dict[str, Any] | None = None  # MoE layers' loads and router losses (megalite.moe.step_metrics), None if dense
    mtp: list[float] | None = None  # each multi-token prediction depth's loss (megalite.mtp.metrics), None if off


def single_stage_engine(model: nn.Module, state: ParallelState, dtype: torch.dtype) -> PipelineEngine:
    """pp = 1: the whole model is one chunk; the schedule is plain gradient accumulation."""
    return PipelineEngine([model], [0], 1, state, (0, 0, 0), dtype)


class StepSettings(Protocol):
    """The train-config fields one step reads (`TrainConfig` has them; tests pass a small namespace)."""

    lr: float
    min_lr: float
    warmup_steps: int
    steps: int
    clip_grad: float


@dataclass(frozen=True)
class StepContext:
    """What stays the same from step to step. The engine already knows the ParallelState, the compute
    dtype and the number of virtual stages, so a step is `train_step(ctx, optimizer, batches, step)`."""

    engine: PipelineEngine
    settings: StepSettings     # learning-rate schedule and clipping
    scaler: LossScaler         # fp16 dynamic loss scale (disabled otherwise); updated by each step
    schedule: str = "1f1b"     # pipeline schedule name (megalite.pipeline.schedules)
    global_token_mean: bool = False  # loss = sum of counted token losses / their number over the step (SFT)

    @classmethod
    def build(cls, model: nn.Module | PipelineEngine, state: ParallelState, dtype: torch.dtype,
              settings: StepSettings, scaler: LossScaler, schedule: str = "1f1b",
              global_token_mean: bool = False) -> StepContext:
        """A context for a pipeline engine, or for a whole model on one stage (pp = 1)."""
        engine = model if isinstance(model, PipelineEngine) else single_stage_engine(model, state, dtype)
        return cls(engine, settings, scaler, schedule, global_token_mean)

    @property
    def vpp(self) -> int:
        return self.engine.num_stages // self.engine.state.pp


def train_step(ctx: StepContext,
               optimizer: DistributedOptimizer,
               batches: list[Batch], step: int, poison_grads: bool = False) -> StepResult:
    """Run one step over this rank's micro-batches; every rank returns the same StepResult."""
    engine, state, scaler, settings = ctx.engine, ctx.engine.state, ctx.scaler, ctx.settings
    for chunk in engine.chunks:
        chunk.train()
    lr = lr_at(step, settings.lr, settings.min_lr, settings.warmup_steps, settings.steps)
    optimizer.zero_grad()
    actions = build_schedule(ctx.schedule, len(batches), state.pp, state.pp_rank, ctx.vpp)
    divisor = token_divisor(batches, state) if ctx.global_token_mean else None
    total = engine.run(actions, batches, scaler.scale, optimizer, divisor)
    optimizer.finish_grad_sync()  # DP reduction (and a tied embedding's pipeline copies summed), once per step
    if poison_grads:  # fault injection (megalite.runtime.faults): exercise the skip path end to end
        optimizer.scale_grads(float("inf"))
    if scaler.enabled:
        optimizer.scale_grads(1.0 / scaler.scale)
    norm = optimizer.grad_norm()  # agreed by every rank: summed over tp x pp, equal over dp
    skipped = not math.isfinite(norm)
    scaler.update(found_inf=skipped)
    if not skipped:
        optimizer.step(lr, settings.clip_grad, norm)
        update_router_biases(engine.chunks, state)  # DeepSeek-V3's aux-loss-free balancing, outside the optimizer
    moe = moe_step_metrics(engine.chunks, state)  # reads the step's loads and router losses
    mtp = mtp_step_metrics(engine.chunks, state)
    if divisor is None:
        total /= len(batches)
    return StepResult(loss=mean_over_ranks(total, state), grad_norm=norm, lr=lr, skipped=skipped, moe=moe,
                      mtp=mtp)


IGNORE_INDEX = -100  # the cross entropy's ignore_index: a label the loss is not on


def token_divisor(batches: list[Batch], state: ParallelState) -> float:
    """N / (dp x cp) for N the labels the step's loss is on, over every micro-batch of every dp x cp rank
    (each pp stage holds the labels and sums over its own dp x cp group). At least one token, so a step
    without any counted label has loss 0 and no gradient instead of 0/0."""
    n = torch.zeros((), dtype=torch.float64, device=state.device)
    for _, labels in batches:
        n += (labels != IGNORE_INDEX).sum().to(n.device, torch.float64)
    comm.all_reduce(n, state, "dp_cp", count_as="metrics")
    return max(float(n.item()), 1.0) / state.size("dp_cp")


def mean_over_ranks(total: torch.Tensor, state: ParallelState) -> float:
    """The global mean token loss from this rank's mean over its tokens. Only the last stage has the loss:
    sum over pp (others add 0), then average over dp x cp. Every cp rank holds the same number of tokens
    (S/cp of each sequence, no token ignored in pretraining), so the mean of the cp ranks' means is the sum
    of all token losses divided once by the token count. Filed under 'metrics': 'dp' holds exactly the
    gradient reduction and 'cp' exactly the attention's K/V traffic."""
    comm.all_reduce(total, state, "pp", count_as="metrics")
    comm.all_reduce(total, state, "dp_cp", count_as="metrics")
    return total.item() / state.size("dp_cp")


@torch.no_grad()
def evaluate(model: nn.Module | PipelineEngine, batches: list[Batch], state: ParallelState,
             dtype: torch.dtype, global_token_mean: bool = False) -> float:
    """Mean token loss over the given micro-batches, averaged over dp x cp ranks (forward only); with
    `global_token_mean`, the mean over every counted label of them all (as `train_step`)."""
    engine = model if isinstance(model, PipelineEngine) else single_stage_engine(model, state, dtype)
    for chunk in engine.chunks:
        chunk.eval()
    divisor = token_divisor(batches, state) if global_token_mean else None
    total = engine.run(forward_only_schedule(len(batches), len(engine.chunks)), batches, 1.0, None, divisor)
    if divisor is None:
        total /= max(1, len(batches))
    return mean_over_ranks(total, state)
