"""megalite/attention/costs.py against brute force: the visible pairs of a windowed causal layer, the ring's chunk
pairs, the flash tile bounds (the kernels' own counts are held to them in tests/test_flash_window.py, the ring's
in tests/test_attention_variants_cp.py). Integers: exact."""

from __future__ import annotations

import pytest

from megalite.attention.costs import (attention_forward_flops, chunk_pair_visible, dense_pairs, flash_dkdv_tiles,
                                      flash_forward_tiles, kv_cache_bytes, ring_blocks, ring_blocks_total,
                                      visible_pairs)


def _sees(i: int, j: int, window: int | None) -> bool:
    return j <= i and (window is None or i - j < window)


@pytest.mark.parametrize("seq,window", [(1, None), (7, None), (7, 1), (7, 3), (7, 7), (7, 20), (33, 8)])
def test_visible_pairs_count_the_window(seq: int, window: int | None) -> None:
    brute = sum(_sees(i, j, window) for i in range(seq) for j in range(seq))
    assert visible_pairs(seq, window) == brute
    assert dense_pairs(seq, window) == seq * min(seq, window or seq)
    assert attention_forward_flops(2, seq, 3, 8, window) == 4.0 * 2 * 3 * 8 * brute


def test_windowed_cost_grows_linearly_past_the_window() -> None:
    w = 16
    steps = [visible_pairs(s, w) - visible_pairs(s - 64, w) for s in (128, 192, 256)]
    assert steps == [64 * w] * 3                                    # linear: W pairs per extra token
    full = [visible_pairs(s) - visible_pairs(s - 64) for s in (128, 192, 256)]
    assert full[0] < full[1] < full[2]                              # quadratic
    assert kv_cache_bytes(1, 4096, 2, 64, 2, window=128) == 2 * 128 * 2 * 64 * 2


@pytest.mark.parametrize("cp,chunk,window", [(2, 4, None), (2, 4, 3), (4, 3, 5), (4, 2, 1), (3, 4, 9)])
def test_ring_blocks_are_the_chunk_pairs_with_a_visible_pair(cp: int, chunk: int, window: int | None) -> None:
    seq = 2 * cp * chunk
    total = ring_blocks_total(seq, cp, window)
    assert total.computed + total.skipped == cp * (2 * cp + 1)
    brute = sum(any(_sees(i, j, window) for i in range(a * chunk, (a + 1) * chunk)
                    for j in range(b * chunk, (b + 1) * chunk))
                for a in range(2 * cp) for b in range(2 * cp))
    assert total.computed == brute
    for a in range(2 * cp):
        for b in range(2 * cp):
            assert chunk_pair_visible(a, b, chunk, window) == any(
                _sees(i, j, window) for i in range(a * chunk, (a + 1) * chunk) for j in range(b * chunk, (b + 1) * chunk))
    assert ring_blocks(seq, cp, 0, None).computed == 2 * cp + 1


@pytest.mark.parametrize("seq,bq,bk,window", [(48, 16, 16, None), (48, 16, 16, 5), (50, 16, 8, 17), (64, 8, 16, 1)])
def test_flash_tile_bounds_cover_exactly_the_tiles_with_a_visible_pair(seq: int, bq: int, bk: int,
                                                                     window: int | None) -> None:
    """The kernels' loop bounds visit every tile holding a visible pair and (with aligned tiles) no other."""
    def has_pair(q0: int, k0: int, nq: int, nk: int) -> bool:
        return any(_sees(i, j, window) for i in range(q0, min(q0 + nq, seq)) for j in range(k0, min(k0 + nk, seq)))

    needed_fwd = sum(has_pair(q0, k0, bq, bk) for q0 in range(0, seq, bq) for k0 in range(0, seq, bk))
    needed_bwd = sum(has_pair(q0, k0, bq, bk) for k0 in range(0, seq, bk) for q0 in range(0, seq, bq))
    assert flash_forward_tiles(seq, bq, bk, window) >= needed_fwd
    assert flash_dkdv_tiles(seq, bq, bk, window) >= needed_bwd
    if bq == bk:
        assert flash_forward_tiles(seq, bq, bk, window) == needed_fwd
        assert flash_dkdv_tiles(seq, bq, bk, window) == needed_bwd


def test_the_costs_load_without_torch() -> None:
    """The estimator imports these: importing them loads no torch (as tests/test_architecture.py asks of each
    feature's costs)."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, megalite.attention.costs; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
