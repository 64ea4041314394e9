"""The gradient sync (`megalite.dp.grad_sync`) is a part of its own: another optimizer plugs onto it
unchanged, and each parameter is reduced over the group its `ParamSpec.grad_group` names.

SGD with momentum (`ShardSGD` below, ~20 lines of math on `Shard`s, no sync code touched) on the gradient
sync at ZeRO 0-3 matches `torch.optim.SGD` on one process. Tolerances (fp32, no clipping): on one process
the only difference is where dW is summed (the linears' fold adds it into the fp32 main grad inside the
GEMM, autograd materialises it), ~1 ulp; at dp = 2 each rank sums its own micro-batches and the reduction
adds the two sums, another ~1e-8 relative. SGD does not amplify round-off (no division by sqrt(v)), so
after 4 steps at lr 0.1 losses agree to 1e-6 and parameters (O(0.02-1)) to 1e-6; a missed shard, a
double-counted reduction or a wrong average moves them by >= 1e-4.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pytest
import torch
import torch.nn as nn

from megalite.dp.grad_sync import GradSync
from megalite.dp.shards import Shard, ShardOptimizer
from megalite.model.gpt import GPT
from megalite.optim.zero import ZeroOptimizer
from megalite.parallel.param_spec import REPLICATED, GradReduction, ParamSpec, children_specs
from megalite.parallel.state import ParallelState
from tests.parallel_utils import (layout, micro_batches, random_steps, reference_optimizer, tiny_model_cfg,
                                  tiny_train_cfg, train_steps)

LR, MOMENTUM, STEPS, MICRO, M = 0.1, 0.9, 4, 2, 2


class ShardSGD:
    """SGD with momentum (torch.optim.SGD's arithmetic, dampening 0, no decay) on the sync's shards."""

    state_kinds = ("master", "momentum_buffer")

    def __init__(self, shards: Sequence[Shard], initial: Sequence[torch.Tensor], momentum: float) -> None:
        self.shards, self.momentum, self.step_count = list(shards), momentum, 0
        self.masters = list(initial)
        self.buffers = [torch.zeros_like(m) for m in self.masters]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        for shard, master, buf in zip(self.shards, self.masters, self.buffers):
            if self.step_count == 1:
                buf.copy_(shard.grad)
            else:
                buf.mul_(self.momentum).add_(shard.grad)
            master.add_(buf, alpha=-lr)
            if master.data_ptr() != shard.params.data_ptr():
                shard.params.copy_(master)

    def state_shards(self) -> list[dict[str, torch.Tensor]]:
        return [{"master": m, "momentum_buffer": b} for m, b in zip(self.masters, self.buffers)]

    def load_state_shards(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        raise NotImplementedError  # not needed here

    def memory_bytes(self) -> dict[str, int]:
        return {"master": 0, "optimizer": sum(b.numel() * 4 for b in self.buffers)}


def _sgd_on_sync(model: nn.Module, st: ParallelState, stage: int) -> ZeroOptimizer:
    sync = GradSync([model], st, stage, torch.float32)
    sgd = ShardSGD(sync.shards(), sync.take_fp32_values(), MOMENTUM)
    assert isinstance(sgd, ShardOptimizer)
    return ZeroOptimizer(sync, sgd)


def _torch_sgd(cfg: object, data: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain autograd and torch.optim.SGD: the oracle."""
    ref = GPT(cfg, ParallelState(), seed=5)
    sgd = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    losses = []
    for d in data:
        sgd.zero_grad()
        total, mbs = 0.0, micro_batches(d, MICRO)  # every rank's micro-batches
        for ids, labels in mbs:
            loss = ref(ids, labels).mean()
            (loss / len(mbs)).backward()
            total += loss.item()
        sgd.step()
        losses.append(total / len(mbs))
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _check_sgd(rank: int, stage: int) -> None:
    st = layout(1) if torch.distributed.is_initialized() else ParallelState()
    cfg = tiny_model_cfg("llama")
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    want_losses, want = _torch_sgd(cfg, data)
    model = GPT(cfg, st, seed=5)
    opt = _sgd_on_sync(model, st, stage)
    per_rank = MICRO * M
    mine = [micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO) for d in data]
    results = train_steps(model, st, opt, mine, tiny_train_cfg(STEPS, lr=LR, clip_grad=0.0))
    for i, (got, expect) in enumerate(zip([r.loss for r in results], want_losses)):
        assert abs(got - expect) <= 1e-6, f"zero={stage} step {i}: loss {got} != torch SGD {expect}"
    for name, value in opt.full_parameters().items():
        err = (value - want[name]).abs().max().item()
        assert err <= 1e-6, f"zero={stage}: {name} off by {err:.2e} from torch.optim.SGD"


def test_sgd_on_the_gradient_sync_matches_torch_sgd_on_one_process() -> None:
    _check_sgd(0, 0)  # dp = 1: every stage is stage 0 here (nothing to shard)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sgd_on_the_gradient_sync_at_dp2_matches_one_process(dist_world, stage: int) -> None:
    dist_world(2).run(_check_sgd, stage)


# ---------------------------------------------------------------- grad_group


class _Block(nn.Module):
    """Two parameters of one ZeRO-3 unit, declared with two different gradient groups."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(n, dtype=torch.float32) / n)
        self.b = nn.Parameter(torch.arange(n, dtype=torch.float32) / -n)

    def param_specs(self) -> Mapping[str, ParamSpec]:
        return {"a": ParamSpec(REPLICATED, grads=GradReduction("dp")), "b": ParamSpec(REPLICATED)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x).sum() + (self.b * x * 2).sum()


class _TwoGroups(nn.Module):
    def __init__(self, n: int = 7) -> None:
        super().__init__()
        self.block = _Block(n)
        self.c = nn.Parameter(torch.ones(n))

    def param_specs(self) -> Mapping[str, ParamSpec]:
        return {"c": ParamSpec(REPLICATED), **children_specs(self)}

    def units(self) -> list[nn.Module]:
        return [self.block]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + (self.c * x * 3).sum()


def _check_grad_groups(rank: int, stage: int) -> None:
    """cp = 2, dp = 2: `block.a` is averaged over dp only (the ranks with this rank's cp rank), `b` and
    `c` over dp x cp; every bucket holds one group; after an SGD step each parameter is gathered whole."""
    st = layout(1, cp=2)
    n = 7
    x = torch.linspace(-1, 1, n) * (1 + st.rank)  # a different gradient on every rank
    dp_peers = torch.distributed.get_process_group_ranks(st.group("dp"))
    mean = {"dp": sum(torch.linspace(-1, 1, n) * (1 + r) for r in dp_peers) / 2,
            "dp_cp": sum(torch.linspace(-1, 1, n) * (1 + r) for r in range(4)) / 4}
    want = {"block.a": mean["dp"], "block.b": 2 * mean["dp_cp"], "c": 3 * mean["dp_cp"]}
    model = _TwoGroups(n)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = _sgd_on_sync(model, st, stage)
    opt.zero_grad()
    model(x).backward()
    opt.finish_grad_sync()
    groups = {name: b.group for b in opt.sync.buckets for p in b.params for name, q in model.named_parameters()
              if p is q}
    assert groups == {"block.a": "dp", "block.b": "dp_cp", "c": "dp_cp"}
    names = opt.sync.names()
    for b, shard in zip(opt.sync.buckets, opt.shards):
        full = torch.zeros(b.padded)
        for p, off in zip(b.params, b.offsets):
            full[off:off + p.numel()] = want[names[id(p)]]
        torch.testing.assert_close(shard.grad, full[b.lo:b.hi], rtol=0, atol=1e-6)  # sums of 2 or 4 floats
    opt.step(LR, 0.0, opt.grad_norm())
    for name, value in opt.full_parameters().items():
        torch.testing.assert_close(value, start[name] - LR * want[name], rtol=0, atol=1e-6)
    # The reference optimizer reduces over the same groups.
    ref_model = _TwoGroups(n)
    ref = reference_optimizer(ref_model, st)
    ref.zero_grad()
    ref_model(x).backward()
    ref.finish_grad_sync()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_parameter_is_reduced_over_its_grad_group(dist_world, stage: int) -> None:
    dist_world(4).run(_check_grad_groups, stage)
