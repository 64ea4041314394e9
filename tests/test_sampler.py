"""The DP-aware sampler (the same samples in the same order at every dp, exact resume) and batch building."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megalite.data import DataSampler, make_batch
from megalite.errors import ConfigError, DataError


def _global_steps(n: int, G: int, mbs: int, dp: int, seed: int, steps: int, consumed: int = 0) -> list[list[int]]:
    """Per step, the concatenation over ranks (in rank order) of their micro-batches."""
    samplers = [DataSampler(n, G, mbs, r, dp, seed, consumed) for r in range(dp)]
    out = []
    for _ in range(steps):
        out.append([i for s in samplers for mb in s.next_step() for i in mb])
    return out


def test_sampler_dp_invariance_epochs_and_resume() -> None:
    n, G, seed = 10, 8, 5
    ref = _global_steps(n, G, 1, 1, seed, steps=6)  # 48 samples: crosses four epoch boundaries
    stream = np.concatenate([np.random.default_rng(seed + e).permutation(n) for e in range(5)])
    assert [i for step in ref for i in step] == stream[:48].tolist()
    for dp, mbs in [(2, 2), (4, 1), (4, 2), (8, 1)]:
        got = _global_steps(n, G, mbs, dp, seed, steps=6)
        assert got == ref  # same samples, same order across ranks, for every dp
    s = DataSampler(n, G, 2, 1, 2, seed)
    mbs = s.next_step()
    assert mbs == [ref[0][4:6], ref[0][6:8]] and s.consumed_samples == G
    # Resume: 3 steps, save, fresh sampler continues identically (step 4 straddles epochs 2 and 3).
    a = DataSampler(n, G, 2, 1, 2, seed)
    for _ in range(3):
        a.next_step()
    b = DataSampler(n, G, 2, 1, 2, seed)
    b.load_state_dict(a.state_dict())
    assert b.consumed_samples == 24
    for _ in range(3):
        assert a.next_step() == b.next_step()
    # O(1) jump: constructing at consumed_samples equals iterating there.
    assert _global_steps(n, G, 1, 1, seed, steps=2, consumed=32) == ref[4:6]
    with pytest.raises(DataError, match="train.seed"):
        DataSampler(n, G, 1, 0, 1, seed + 1).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="multiple of"):
        DataSampler(n, 6, 2, 0, 4, seed)


def test_make_batch() -> None:
    ds = [np.arange(i, i + 5) for i in range(0, 50, 10)]
    x, y = make_batch(ds, [3, 1])  # type: ignore[arg-type]
    assert x.dtype == torch.int64 and x.shape == (2, 4) and y.shape == (2, 4)
    assert x.tolist() == [[30, 31, 32, 33], [10, 11, 12, 13]] and y.tolist() == [[31, 32, 33, 34], [11, 12, 13, 14]]
