"""The simulated bubble of each schedule as implemented equals the closed forms (exact fractions)."""

from __future__ import annotations

import pytest

from megalite.pipeline.simulate import ascii_timeline, simulate


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_factor", [1, 2, 4])
def test_bubble_matches_closed_forms(p: int, m_factor: int) -> None:
    m = p * m_factor
    for schedule in ("gpipe", "1f1b"):
        tl = simulate(schedule, p, m)
        assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), schedule
    for v in (2, 4):
        tl = simulate("interleaved", p, m, vpp=v)
        assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), f"v={v}"


def test_seed_examples_and_1f1b_does_not_halve_the_bubble() -> None:
    assert round(100 * simulate("1f1b", 8, 16).bubble_fraction, 1) == 30.4
    assert round(100 * simulate("1f1b", 16, 32).bubble_fraction, 1) == 31.9
    assert simulate("1f1b", 8, 16).bubble_fraction == pytest.approx(simulate("gpipe", 8, 16).bubble_fraction)


def test_ascii_timeline_shows_every_rank() -> None:
    text = ascii_timeline(simulate("1f1b", 4, 8), 4)
    assert text.count("rank ") == 4 and "F0" in text and "b7" in text
