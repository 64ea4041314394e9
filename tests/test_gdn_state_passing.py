"""Context parallelism by state passing against one process, on gloo ranks: each cp rank's output and the
gradients of its q, k, v, g and beta equal that slice of the single-process run, with documents crossing a rank
boundary and one starting exactly at it, for contiguous slices and megalite's zigzag split, and the bytes counted
equal `costs.cp_exchange_bytes`.

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


def _check(rank: int, cp: int, packed: bool, zigzag: bool) -> dict[str, float]:
    from megalite.context.zigzag import zigzag_split
    from tests.parallel_utils import layout

    st = layout(1, cp=cp)
    inputs = _inputs()
    n = 2 * cp if zigzag else cp
    length = S // n
    # Row 0: a document across every slice boundary; row 1: a document starting exactly at slice 1's first token.
    ids = torch.tensor([[0] * 5 + [1] * 38 + [2] * 5, [0] * length + [1] * (S - length)]) if packed else None
    d_o = torch.randn(B, S, H, V, generator=torch.Generator().manual_seed(4))
    full = [x.clone().requires_grad_(True) for x in inputs]
    o_full, _ = gated_delta(RuleInputs(*full), doc_ids=ids, scale=K ** -0.5, chunk_size=16)
    g_full = _grads(full, o_full, d_o)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return zigzag_split(t, cp, st.cp_rank) if zigzag else t[:, st.cp_rank * length:(st.cp_rank + 1) * length]

    xs = [mine(x).clone().requires_grad_(True) for x in inputs]
    st.counter.reset()
    o = state_passing_gated_delta(RuleInputs(*xs), doc_ids=ids, scale=K ** -0.5, state=st, zigzag=zigzag,
                                  chunk_size=16)
    assert (o - mine(o_full)).abs().max() <= ATOL, "output"
    for name, g, ref in zip(("q", "k", "v", "g", "beta"), _grads(xs, o, mine(d_o)), g_full):
        err = (g - mine(ref)).abs().max().item()
        assert err <= ATOL, f"gradient of {name}: {err:.3e}"
    return st.counter.bytes()


@pytest.mark.parametrize("world,packed,zigzag", [(2, False, False), (2, True, False), (4, True, False),
                                                 (2, True, True), (4, True, True)])
def test_state_passing_matches_one_process(dist_world, world: int, packed: bool, zigzag: bool) -> None:
    for counted in dist_world(world).run(_check, world, packed, zigzag):
        dims = RecurrentDims(heads=H, key_dim=K, value_dim=V, conv_channels=0)
        # the all-gather and its reduce-scatter, of one map per slice
        assert counted["cp"] == 2 * cp_exchange_bytes(dims, B, world, 2 if zigzag else 1)


def test_slice_starts() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert slice_starts(ids, 3).tolist() == [[False, False], [True, False], [False, False]]
    assert slice_starts(None, 3) is None
