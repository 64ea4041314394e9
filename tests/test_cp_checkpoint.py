"""Checkpoints do not depend on cp: saved by a cp run (ZeRO state sharded over dp x cp), loaded by one
process, and saved by one process, loaded by a cp x tp (+sp) run with ZeRO-3; the next step equals.

Tolerance: the stored fp32 parameters and Adam moments round-trip bitwise (asserted with torch.equal);
the next step is then computed by two layouts from identical state, which differ only in summation
order (see tests/test_cp_training.py): losses within 1e-5, gradient norms within 1e-5 relative.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.checkpoint.sharded import load_sharded, save_sharded
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.parallel.state import ParallelState
from megalite.training.step import StepResult, train_step
from tests.parallel_utils import (layout, micro_batches, random_steps, step_context, tiny_model_cfg,
                                  tiny_train_cfg)
from tests.parallel_utils import ADAMW
from tests.test_cp_training import MICRO, SEQ, local_batches

STEPS = 3


def _step(model: GPT, st: ParallelState, opt, batches, i: int) -> StepResult:
    return train_step(step_context(model, st, torch.float32, tiny_train_cfg(STEPS)), opt,
                      batches, i)


def _assert_same_next_step(a: StepResult, b: StepResult, what: str) -> None:
    assert abs(a.loss - b.loss) <= 1e-5, f"{what}: next-step loss {a.loss} != {b.loss}"
    assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * b.grad_norm, f"{what}: grad norm {a.grad_norm} != {b.grad_norm}"


def _saved_at_cp_loaded_alone(rank: int, root: str) -> None:
    st = layout(1, cp=2)  # dp = 2: ZeRO-1 shards over the 4 ranks of dp x cp
    cfg = tiny_model_cfg("llama", seq_len=SEQ)
    data = random_steps(cfg, STEPS, 2 * MICRO * st.dp)
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, 1, dtype=torch.float32, optimizer=ADAMW)
    for i in range(STEPS - 1):
        _step(model, st, opt, local_batches(data[i], st), i)
    path = save_sharded(root, STEPS - 1, model, opt, {}, st, keep=1)
    saved_params, saved_states = opt.full_parameters(), opt.param_states()
    next_cp = _step(model, st, opt, local_batches(data[-1], st), STEPS - 1)
    if rank != 0:
        return
    one = ParallelState()
    alone = GPT(cfg, one, seed=77)  # another init: everything must come from the checkpoint
    alone_opt = build_distributed_optimizer(alone, one, 0, dtype=torch.float32, optimizer=ADAMW)
    load_sharded(path, alone, alone_opt, one)
    real = {"head.weight": cfg.vocab_size, "embedding.weight": cfg.vocab_size}  # rows past it: padding, not stored
    for name, value in alone_opt.full_parameters().items():
        assert torch.equal(value[:real.get(name)], saved_params[name][:real.get(name)]), name
    for name, kinds in alone_opt.param_states().items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(kinds[kind][:real.get(name)], saved_states[name][kind][:real.get(name)]), name
    next_one = _step(alone, one, alone_opt, micro_batches(data[-1], MICRO), STEPS - 1)
    _assert_same_next_step(next_one, next_cp, "saved at cp=2 dp=2 zero=1, loaded at cp=1")


def _saved_alone_loaded_at_cp(rank: int, root: str) -> None:
    cfg = tiny_model_cfg("llama", seq_len=SEQ)
    data = random_steps(cfg, STEPS, 2 * MICRO)
    one = ParallelState()
    alone = GPT(cfg, one, seed=5)
    alone_opt = build_distributed_optimizer(alone, one, 0, dtype=torch.float32, optimizer=ADAMW)
    for i in range(STEPS - 1):
        _step(alone, one, alone_opt, micro_batches(data[i], MICRO), i)
    if rank == 0:
        save_sharded(root, STEPS - 1, alone, alone_opt, {}, one, keep=1)
    dist.barrier()
    next_one = _step(alone, one, alone_opt, micro_batches(data[-1], MICRO), STEPS - 1)
    st = layout(2, sp=True, cp=2)  # tp = 2 x cp = 2, dp = 1: ZeRO-3 shards over the 2 cp ranks
    model = GPT(cfg, st, seed=77)
    opt = build_distributed_optimizer(model, st, 3, dtype=torch.float32, optimizer=ADAMW)
    with opt.gathered():
        load_sharded(f"{root}/step_{STEPS - 1:08d}", model, opt, st)
    next_cp = _step(model, st, opt, local_batches(data[-1], st), STEPS - 1)
    _assert_same_next_step(next_cp, next_one, "saved at cp=1, loaded at tp=2 cp=2 sp zero=3")


def test_checkpoint_saved_at_cp_loads_in_one_process(dist_world, tmp_path) -> None:
    dist_world(4).run(_saved_at_cp_loaded_alone, str(tmp_path / "ckpt"))


def test_checkpoint_saved_in_one_process_loads_at_cp(dist_world, tmp_path) -> None:
    dist_world(4).run(_saved_alone_loaded_at_cp, str(tmp_path / "ckpt"))
