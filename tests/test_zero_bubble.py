"""Zero-bubble schedules (Qi et al. 2024): action lists, simulated bubbles against the closed forms,
the timeline tool and the config rules. The engine's B/W split and the multi-rank parity are in
tests/test_zero_bubble_engine.py."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from megalite.pipeline import schedules
from megalite.pipeline.partition import chunk_virtual_stages, stage_rank
from megalite.pipeline.schedules import SCHEDULES, build_schedule, chunk_stages, max_in_flight
from megalite.pipeline.simulate import simulate

GRID = [(p, m) for p in (2, 4, 8) for m in (p, p + 1, 2 * p, 2 * p + 3, 4 * p)]


def _vpp(name: str) -> int:
    return {"interleaved": 2, "zbv": 2}.get(name, 1)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5), (1, 2, 1), (1.5, 1, 1), (1, 3, 1), (2, 1, 0.9)])
def test_zb_h1_bubble_is_the_closed_form(p: int, m: int, costs: tuple[float, float, float]) -> None:
    """Qi et al.: ZB-H1's step is M(t_f + t_b + t_w) + (P-1)(t_f + t_b - t_w), here whenever
    t_w <= t_b (a longer W no longer fits the gap the next B leaves; the paper's regime is t_w ~ t_b)."""
    t_f, t_b, t_w = costs
    tl = simulate("zb-h1", p, m, 1, t_f, t_b, t_w)
    assert tl.step_time == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w), abs=1e-9)
    assert tl.bubble_fraction < simulate("1f1b", p, m, 1, t_f, t_b, t_w).bubble_fraction
    heavy_w = simulate("zb-h1", p, m, 1, 1, 1, 3)  # outside the closed form, still no worse than 1F1B
    assert heavy_w.bubble_fraction <= simulate("1f1b", p, m, 1, 1, 1, 3).bubble_fraction + 1e-12


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_idles_a_third_of_1f1b(p: int, m: int) -> None:
    """Equal costs: the idle time per rank is exactly a third of 1F1B's (the fractions differ a little
    because the step is shorter)."""
    idle_1f1b = simulate("1f1b", p, m).step_time - 3 * m
    idle_zb = simulate("zb-h1", p, m).step_time - 3 * m
    assert Fraction(idle_zb) / Fraction(idle_1f1b) == Fraction(1, 3)
    assert simulate("zb-h1", p, m).bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_bubble_is_warm_up_only(p: int) -> None:
    """Equal costs: ZB-V's idle time does not grow with M and is the least possible, (P-1)/2 stage-
    forwards (the last rank waits that long for its first input; nothing else can fill it)."""
    for m in (p, 2 * p, 3 * p, 4 * p, 8 * p):
        assert simulate("zbv", p, m, 2).step_time - 3 * m == (p - 1) / 2, m
    assert simulate("zbv", p, 4 * p, 2).bubble_fraction < 0.04  # 2-3.5%; 1F1B: (P-1)/(5P-1), 11-26% here


def test_zbv_greedy_never_needs_its_fallback() -> None:
    """The memory-bounded greedy finishes for every P <= 8 and M in [P, 4P+3], and at both ends of that
    M range for P = 12 and 16 (the replay raises `_Stuck` otherwise; the whole P <= 16 grid passes too,
    but costs ~20 s of pure Python); its fallback, with slots reserved up front, is valid too."""
    cases = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 4)]
    cases += [(p, m) for p in (12, 16) for m in (p, 4 * p + 3)]
    for p, m in cases:
        schedules._greedy_v(m, p, reserve=False)
    for p, m in ((2, 4), (4, 8), (4, 11), (8, 16)):
        lists = schedules._greedy_v(m, p, reserve=True)
        for acts in lists:
            assert sorted(acts) == sorted((k, mb, c) for k in "FBW" for mb in range(m) for c in (0, 1))
            assert max_in_flight(list(acts)) <= 2 * p


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_beats_every_other_schedule_at_equal_costs(p: int) -> None:
    """ZB-V's order is built for t_f = t_b = t_w (see schedules.py); there it idles least (at P=2 as
    little as ZB-H1: both wait one stage-forward)."""
    for m in (2 * p, 4 * p):
        zbv = simulate("zbv", p, m, 2).bubble_fraction
        assert zbv < min(simulate(n, p, m, _vpp(n)).bubble_fraction for n in ("1f1b", "interleaved"))
        assert zbv <= simulate("zb-h1", p, m).bubble_fraction + 1e-12


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", GRID)
def test_every_rank_list_is_consistent(name: str, p: int, m: int) -> None:
    """Each (micro-batch, chunk) has one F, one B and at most one W, in that order; every message a
    rank sends (an activation to the next stage, a gradient to the previous) is received by the rank
    holding that stage; and the dependency replay finishes (no deadlock)."""
    if name == "interleaved" and m % p:
        return
    v = _vpp(name)
    n_stages = p * v
    lists = [build_schedule(name, m, p, r, v) for r in range(p)]
    held = {(r, c): vs for r in range(p) for c, vs in enumerate(chunk_stages(name, r, p, v))}
    assert sorted(held.values()) == list(range(n_stages))
    assert all(stage_rank(vs, p, name == "zbv") == r for (r, _), vs in held.items())
    received = set()
    for r, acts in enumerate(lists):
        seen = {kind: [] for kind in "FBW"}
        for kind, mb, c in acts:
            seen[kind].append((mb, c))
            if kind == "B":
                assert (mb, c) in seen["F"], f"{name} rank {r}: B{mb} before its F"
            if kind == "W":
                assert (mb, c) in seen["B"], f"{name} rank {r}: W{mb} before its B"
            if kind in "FB":
                received.add((kind, mb, held[(r, c)]))
        everything = sorted((mb, c) for mb in range(m) for c in range(v))
        assert sorted(seen["F"]) == everything and sorted(seen["B"]) == everything
        assert len(set(seen["W"])) == len(seen["W"]) and (not seen["W"] or sorted(seen["W"]) == everything)
    for kind, mb, vs in list(received):  # the receiver of each message exists
        if kind == "F" and vs < n_stages - 1:
            assert ("F", mb, vs + 1) in received
        if kind == "B" and vs > 0:
            assert ("B", mb, vs - 1) in received
    simulate(name, p, m, v)  # raises on a deadlock


@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_memory_is_1f1b_peak(p: int, m: int) -> None:
    """ZB-H1: at most P micro-batches in flight (F until W) on any rank, 1F1B's peak on its first
    stage. ZB-V: at most 2P half-stage chunks on every rank, the same bytes."""
    peak_1f1b = max(max_in_flight(build_schedule("1f1b", m, p, r)) for r in range(p))
    assert peak_1f1b == p
    assert max(max_in_flight(build_schedule("zb-h1", m, p, r)) for r in range(p)) == peak_1f1b
    assert max(max_in_flight(build_schedule("zbv", m, p, r, 2)) for r in range(p)) <= 2 * peak_1f1b


def test_v_placement() -> None:
    assert [chunk_virtual_stages(r, 4, 2, v_shape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank(vs, 4, True) for vs in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="vpp=2"):
        build_schedule("zbv", 8, 4, 0, vpp=3)


def test_timeline_tool_draws_all_five(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.pipeline_timeline import main

    png = tmp_path / "t.png"
    assert main(["--pp", "4", "--micro-batches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"):
        assert f"{name}: P=4 M=8" in out
    assert "zb-h1: P=4 M=8 v=1: bubble 11.1% of the step (closed form 11.1%)" in out
    assert png.stat().st_size > 10_000


def _problems(**overrides: object) -> str:
    from megalite.config import parse_args, resolve, validate
    from megalite.errors import ConfigError

    argv = [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    try:
        world = int(overrides.get("parallel__pp", 1))  # type: ignore[call-overload]
        validate(resolve(parse_args(argv), world), world)
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("overrides,message", [
    ({"parallel__schedule": "zb-h1"}, "parallel.schedule=zb-h1 needs parallel.pp > 1"),
    ({"parallel__schedule": "zb-h1", "parallel__pp": 2, "parallel__vpp": 2}, "set parallel.vpp=1"),
    ({"parallel__schedule": "zbv", "parallel__pp": 2, "model__arch": "llama"}, "set parallel.vpp=2 (got 1)"),
    ({"parallel__schedule": "zbv", "parallel__pp": 2, "parallel__vpp": 2, "model__arch": "gpt2"},
     "tied embeddings do not support yet"),
    ({"parallel__vpp": 2, "parallel__pp": 2, "parallel__schedule": "zb-h1"}, "zb-h1 runs one chunk per rank"),
])
def test_config_rules(overrides: dict[str, object], message: str) -> None:
    assert message in _problems(**overrides, train__global_batch_size=64, model__num_layers=4)


def test_config_accepts_zero_bubble_layouts() -> None:
    assert _problems(parallel__schedule="zb-h1", parallel__pp=2, train__global_batch_size=64) == ""
    assert _problems(parallel__schedule="zbv", parallel__pp=2, parallel__vpp=2, model__arch="llama",
                     model__num_layers=4, train__global_batch_size=64) == ""
