"""AdamW on flat shards (`shard_adamw.adamw_flat`) against torch.optim.AdamW.

The fused path must equal `torch.optim.AdamW(fused=True)` (decay on matrices only) bit for bit: the
same kernel on the same elements. Any dp shard of a padded bucket must hold exactly the replicated
update's values (the kernel is elementwise and position-independent): that is what lets ZeRO 1-3
claim the same parameters as ZeRO 0. The unfused fallback is the `foreach=False` arithmetic; it may
differ from the fused kernel by an ulp where the kernel fuses a multiply-add, so parameters (O(1))
are compared to 1e-6 absolute after 3 steps at lr 1e-2 — a wrong bias correction, a missing decay or
a skipped piece moves them by >= 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megalite.dp.buckets import Bucket, make_bucket
from megalite.optim.shard_adamw import AdamWState, adamw_flat, adamw_flat_unfused
from megalite.parallel.param_spec import REPLICATED, ParamSpec

LR, WD, BETAS, EPS, STEPS = 1e-2, 0.1, (0.9, 0.95), 1e-8, 3


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 11), (1,)]  # odd sizes: shards cut parameters in two
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _specs(params: list[nn.Parameter]) -> dict[nn.Parameter, ParamSpec]:
    return {p: ParamSpec(REPLICATED) for p in params}


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10.0 ** -torch.randint(0, 6, (1,), generator=g).item()
            for p in params]


def _run_flat(dp: int, rank: int, update, wd: float = WD) -> torch.Tensor:
    """STEPS updates of rank `rank`'s shard of a bucket padded for `dp`; returns the shard's params."""
    params = _params()
    b, full = make_bucket(params, _specs(params), dp, rank, pad=True)
    own = full[b.lo:b.hi].clone()
    st = AdamWState(own, torch.zeros_like(own), torch.zeros_like(own))
    for step in range(1, STEPS + 1):
        flat = torch.zeros(b.padded)
        for g, off in zip(_grads(params, step), b.offsets):
            flat[off:off + g.numel()] = g.reshape(-1)
        update(st, flat[b.lo:b.hi], b.segments, LR, wd, BETAS, EPS, step)
    return st.master


def _reference(fused: bool, wd: float = WD) -> torch.Tensor:
    params = _params()
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=fused, foreach=False if not fused else None)
    for step in range(1, STEPS + 1):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("wd", [WD, 0.0])
def test_fused_flat_equals_torch_fused_adamw_bitwise(wd: float) -> None:
    got = _run_flat(1, 0, adamw_flat, wd)
    assert torch.equal(got, _reference(fused=True, wd=wd))


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_every_shard_equals_the_replicated_update_bitwise(dp: int) -> None:
    whole = _run_flat(1, 0, adamw_flat)
    n = whole.numel()
    shards = torch.cat([_run_flat(dp, r, adamw_flat) for r in range(dp)])
    assert torch.equal(shards[:n], whole)
    assert torch.count_nonzero(shards[n:]) == 0  # padding stays zero: no gradient, no moments


def test_unfused_fallback_matches_torch_single_tensor_and_fused() -> None:
    unfused = _run_flat(1, 0, adamw_flat_unfused)
    assert torch.equal(unfused, _reference(fused=False))  # the same ops in the same order
    assert (unfused - _run_flat(1, 0, adamw_flat)).abs().max().item() <= 1e-6


def test_bucket_type_is_what_the_optimizer_uses() -> None:
    params = _params()
    b, _ = make_bucket(params, _specs(params), 1, 0, pad=False)
    assert isinstance(b, Bucket) and [s.decay for s in b.segments] == [True, False, True, False]
