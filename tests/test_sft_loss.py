"""SFT's loss is one token mean over the step: every counted label (not -100) of every micro-batch of every rank,
divided once by their number, so dp 1, 2 and 4 and any gradient accumulation give the same loss and gradient as
that mean computed by hand in one process (megalite/training/step.py, `global_token_mean`)."""

from __future__ import annotations

import pytest
import torch

from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from megalite.training.step import StepContext, train_step
from megalite.optim.loss_scale import LossScaler
from tests.parallel_utils import layout, reference_optimizer, tiny_model_cfg, tiny_train_cfg

# fp32 sums of the same token losses in another order (micro-batches, ranks): a few ulps of O(1) values.
ATOL = 2e-6
G = 8  # sequences per step


def _data(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [G, S+1] and labels [G, S] with -100 off a mask of very different density per row: row 0 has no
    counted label, row 1 one, the others a random share, so a mean of micro-batch means is visibly wrong."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (G, cfg.seq_len + 1), generator=gen)
    density = torch.tensor([0.0, 0.0, 0.2, 0.9, 0.5, 1.0, 0.3, 0.7]).unsqueeze(1)
    mask = torch.rand(G, cfg.seq_len, generator=gen) < density
    mask[1, 3] = True
    return tokens, torch.where(mask, tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))


def _step(model: GPT, state: ParallelState, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict]:
    """One step with lr 0 (the weights stay put), returning the loss and the dp-reduced gradients."""
    opt = reference_optimizer(model, state, lr=0.0, weight_decay=0.0)
    ctx = StepContext.build(model, state, torch.float32, tiny_train_cfg(lr=0.0, clip_grad=0.0), LossScaler(False),
                            global_token_mean=True)
    result = train_step(ctx, opt, batches, 0)
    return result.loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _micro(ids: torch.Tensor, labels: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(ids[i:i + m], labels[i:i + m]) for i in range(0, ids.shape[0], m)]


def _check(rank: int, world: int) -> None:
    cfg = tiny_model_cfg()
    tokens, labels = _data(cfg)
    ids = tokens[:, :-1]
    # By hand, one process: the per-token losses of the whole batch, summed where counted, divided once.
    ref = GPT(cfg, ParallelState(), seed=5)
    per_token = ref(ids, labels)
    counted = labels != -100
    loss = per_token[counted].sum() / counted.sum()
    loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    mean_of_means = sum(per_token[i:i + 2][counted[i:i + 2]].mean().nan_to_num() for i in range(0, G, 2)) / (G // 2)
    assert abs(float(mean_of_means) - float(loss)) > 100 * ATOL  # the data tells the two means apart

    def same(got_loss: float, grads: dict, what: str) -> None:
        assert abs(got_loss - float(loss)) <= ATOL, f"{what}: loss {got_loss} != {float(loss)}"
        for n, g in want.items():
            err = (grads[n] - g).abs().max().item()
            assert err <= ATOL, f"{what}: {n} grad off by {err}"

    if rank == 0:  # dp 1, with and without gradient accumulation
        for m in (G, 2, 1):
            same(*_step(GPT(cfg, ParallelState(), seed=5), ParallelState(), _micro(ids, labels, m)), f"dp1 micro {m}")
    st = layout(1)  # dp = world
    per = G // st.dp
    mine = slice(st.dp_rank * per, (st.dp_rank + 1) * per)
    for m in sorted({per, 1}):
        same(*_step(GPT(cfg, st, seed=5), st, _micro(ids[mine], labels[mine], m)), f"dp{st.dp} micro {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_sft_loss_is_one_token_mean_at_any_dp_and_accumulation(dist_world, world: int) -> None:
    dist_world(world).run(_check, world)
