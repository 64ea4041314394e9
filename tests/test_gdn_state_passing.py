"""Context parallelism by state passing against one process, on gloo ranks: each cp rank's output and the
gradients of its q, k, v, g and beta equal that slice of the single-process run, with documents crossing a rank
boundary and one starting exactly at it, and the bytes counted equal `costs.cp_exchange_bytes`.

Tolerance (fp32): the same recurrence, with the state entering each slice composed from the maps instead of
carried token by token: ~1e-7 relative on O(1) values; 1e-5 absolute, while a missed or misplaced state is O(0.1).
"""

from __future__ import annotations

import pytest
import torch

from megalite.recurrent.costs import RecurrentDims, cp_exchange_bytes
from megalite.recurrent.engine import gated_delta
from megalite.recurrent.recurrence import RuleInputs
from megalite.recurrent.state_passing import slice_starts, state_passing_gated_delta

ATOL = 1e-5
B, S, HK, H, K, V = 2, 48, 1, 2, 8, 4


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(B, S, HK, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, S, H, V, generator=gen)
    return [q, k, v, -torch.rand(B, S, H, generator=gen) * 0.3, torch.rand(B, S, H, generator=gen)]


def _grads(xs: list[torch.Tensor], o: torch.Tensor, d_o: torch.Tensor) -> list[torch.Tensor]:
    (o * d_o).sum().backward()
    return [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def _check(rank: int, cp: int, packed: bool) -> dict[str, float]:
    from tests.parallel_utils import layout

    st = layout(1, cp=cp)
    inputs = _inputs()
    length = S // cp
    # Row 0: a document across every rank boundary; row 1: a document starting exactly at rank 1's first token.
    ids = torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * length + [1] * (S - length)]) if packed else None
    d_o = torch.randn(B, S, H, V, generator=torch.Generator().manual_seed(4))
    full = [x.clone().requires_grad_(True) for x in inputs]
    o_full, _ = gated_delta(RuleInputs(*full), doc_ids=ids, scale=K ** -0.5, chunk_size=16)
    g_full = _grads(full, o_full, d_o)
    mine = slice(st.cp_rank * length, (st.cp_rank + 1) * length)
    xs = [x[:, mine].clone().requires_grad_(True) for x in inputs]
    st.counter.reset()
    o = state_passing_gated_delta(RuleInputs(*xs), doc_ids=ids, scale=K ** -0.5, state=st, chunk_size=16)
    assert (o - o_full[:, mine]).abs().max() <= ATOL, "output"
    for name, g, ref in zip(("q", "k", "v", "g", "beta"), _grads(xs, o, d_o[:, mine]), g_full):
        err = (g - ref[:, mine]).abs().max().item()
        assert err <= ATOL, f"gradient of {name}: {err:.3e}"
    return st.counter.bytes()


@pytest.mark.parametrize("world,packed", [(2, False), (2, True), (4, True)])
def test_state_passing_matches_one_process(dist_world, world: int, packed: bool) -> None:
    for counted in dist_world(world).run(_check, world, packed):
        dims = RecurrentDims(heads=H, key_dim=K, value_dim=V, conv_channels=0)
        assert counted["cp"] == 2 * cp_exchange_bytes(dims, B, world)  # the all-gather and its reduce-scatter


def test_slice_starts() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert slice_starts(ids, 3).tolist() == [[False, False], [True, False], [False, False]]
    assert slice_starts(None, 3) is None
