"""Mixed precision with the ZeRO optimizer: bf16 params with fp32 master weights and fp32 gradient
accumulation, and fp16 dynamic loss scaling that skips a step with an inf/nan gradient."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.training.step import train_step
from tests.parallel_utils import ADAMW, layout, step_context, tiny_model_cfg, tiny_train_cfg

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _batches(cfg, steps: int, rank: int, per_rank: int = 4, micro: int = 2) -> list[list]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        d = torch.randint(0, cfg.vocab_size, (per_rank * 2, cfg.seq_len + 1), generator=gen)
        d = d[rank * per_rank:(rank + 1) * per_rank]
        out.append([(d[i:i + micro, :-1], d[i:i + micro, 1:]) for i in range(0, per_rank, micro)])
    return out


def _check_fp16_skip(rank: int, stage: int) -> None:
    """An inf written into one gradient at step 2 skips exactly that step and halves the scale."""
    st = layout(1)
    cfg = tiny_model_cfg("llama")
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, stage, dtype=torch.float16, optimizer=ADAMW)
    # Only rank 0 injects: the DP reduction must carry the inf to every rank's norm.
    inject = {"on": False}
    # A norm weight: its gradient is a `.grad` tensor (a linear's weight gradient goes straight into the
    # optimizer's buffer, `layers.linear_fn`, so a tensor hook on it sees none).
    victim = model.layers["0"].norm2.weight
    victim.register_hook(lambda g: torch.full_like(g, math.inf) if inject["on"] and st.dp_rank == 0 else g)
    init_scale = 2.0 ** 10
    scaler = LossScaler(enabled=True, init_scale=init_scale, growth_interval=1000)
    tcfg = tiny_train_cfg(6)
    results, scales = [], []
    same = _batches(cfg, 1, st.dp_rank)[0]  # one batch, repeated: the loss must fall as it is memorised
    for i, batches in enumerate([same] * 6):
        inject["on"] = i == 2
        before = opt.full_parameters() if i == 2 else None
        results.append(train_step(step_context(model, st, torch.float16, tcfg, scaler=scaler), opt, batches, i))
        scales.append(scaler.scale)
        if before is not None:  # a skipped step leaves every parameter untouched
            after = opt.full_parameters()
            assert all(torch.equal(before[k], after[k]) for k in before)
    assert [r.skipped for r in results] == [False, False, True, False, False, False], results
    assert scales == [init_scale] * 2 + [init_scale / 2] * 4, scales
    assert opt.optimizer.step_count == 5
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for i, r in enumerate(results) if i != 2)
    assert results[-1].loss < results[3].loss < results[0].loss, \
        f"training did not continue after the skipped step: {[r.loss for r in results]}"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_inf_skips_one_step_and_lowers_scale(dist_world, stage: int) -> None:
    dist_world(2).run(_check_fp16_skip, stage)


def _check_bf16_tracks_fp32(rank: int, stage: int) -> None:
    """bf16 compute with fp32 master/grad accumulation follows the fp32 run. Tolerance: bf16 keeps 8
    mantissa bits (relative round-off 2^-9 ~ 2e-3 per op); over 5 steps the loss (~4) stays within
    0.05 of fp32, while a lost update (e.g. master not written back) leaves it off by > 0.1."""
    st = layout(1)
    cfg = tiny_model_cfg("gpt2")
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT(cfg, st, seed=5)
        opt = build_distributed_optimizer(model, st, stage, dtype=dtype, optimizer=ADAMW)
        losses[dtype] = [train_step(step_context(model, st, dtype, tiny_train_cfg(5)),
                                    opt, b, i).loss
                         for i, b in enumerate(_batches(cfg, 1, st.dp_rank) * 5)]  # memorise one batch
        if dtype == torch.bfloat16:
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert all(s.master.dtype == torch.float32 for s in opt.optimizer.states)
            assert all(s.grad.dtype == torch.float32 for s in opt.shards)
    diff = max(abs(a - b) for a, b in zip(losses[torch.float32], losses[torch.bfloat16]))
    assert diff < 0.05, f"bf16 loss deviates from fp32 by {diff}"
    assert losses[torch.bfloat16][-1] < losses[torch.bfloat16][0] - 0.1, losses


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_tracks_fp32(dist_world, stage: int) -> None:
    dist_world(2).run(_check_bf16_tracks_fp32, stage)
