"""Checkpoints across ZeRO stages: save at one stage, load at another (dp=2), same state and next step.

Tolerance: the optimizer state round-trips bitwise (fp32 tensors stored as they are); the next step's
loss is then computed from identical parameters, and stages differ only in how the reduced gradient
is summed (all-reduce vs reduce-scatter: same pairwise sums on 2 ranks), so 1e-6 is generous.
"""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint import sharded
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.training.step import train_step
from tests.parallel_utils import ADAMW, layout, step_context, tiny_model_cfg, tiny_train_cfg


def _batches(step: int, cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    d = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return [(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])]


def _check(rank: int, root: str, src: int, dst: int) -> None:
    st = layout(1)  # dp = 2
    cfg = tiny_model_cfg("llama")
    tcfg = tiny_train_cfg(5)
    model = GPT(cfg, st, seed=1)
    opt = build_distributed_optimizer(model, st, src, torch.float32, optimizer=ADAMW)
    mine = lambda s: _batches(s, cfg)[st.dp_rank:st.dp_rank + 1]  # noqa: E731
    for s in range(2):
        train_step(step_context(model, st, torch.float32, tcfg), opt, mine(s), s)
    path = sharded.save_sharded(root, 2, model, opt, {}, st, keep=2)
    model2 = GPT(cfg, st, seed=77)  # different init: everything must come from the checkpoint
    opt2 = build_distributed_optimizer(model2, st, dst, torch.float32, optimizer=ADAMW)
    with opt2.gathered():
        sharded.load_sharded(path, model2, opt2, st)
    a, b = opt.full_parameters(), opt2.full_parameters()
    assert a.keys() == b.keys()
    for k in a:  # rows past the real vocabulary are padding: never used, stored as zeros
        rows = cfg.vocab_size if k in ("head.weight", "embedding.weight") else None
        assert torch.equal(a[k][:rows], b[k][:rows]), k
    sa, sb = opt.param_states(), opt2.param_states()
    for k in sa:
        for kind in ("exp_avg", "exp_avg_sq"):
            rows = cfg.vocab_size if k in ("head.weight", "embedding.weight") else None
            assert torch.equal(sa[k][kind][:rows], sb[k][kind][:rows]), f"{k} {kind}"
    la = train_step(step_context(model, st, torch.float32, tcfg), opt, mine(2), 2).loss
    lb = train_step(step_context(model2, st, torch.float32, tcfg), opt2, mine(2), 2).loss
    assert abs(la - lb) <= 1e-6, (la, lb)


@pytest.mark.parametrize("src,dst", [(2, 0), (0, 3), (3, 1), (1, 2)])
def test_checkpoint_moves_between_zero_stages(dist_world, tmp_path, src: int, dst: int) -> None:
    dist_world(2).run(_check, str(tmp_path / "ckpt"), src, dst)
