"""Pipeline schedules as the cost model sees them: the bubble (the share of a step a stage idles) and the
activations a stage holds at peak. Each schedule is one `SCHEDULES` entry, so adding one (zero-bubble
schedules, say) is a table row with its two formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megalite.errors import ConfigError
from megalite.perfmodel.inputs import Layout


def pipeline_bubble(p: int, m: int, v: int = 1) -> float:
    """Fraction of a step each stage idles: (p-1)/(v·m + p-1) (Narayanan et al. 2021).

    GPipe and 1F1B have the same bubble, (p-1)/(m+p-1): P=8, M=16 -> 30.4%; P=16, M=32 -> 31.9%.
    1F1B does NOT halve it (a common claim); what 1F1B changes is memory: at most p
    micro-batches' activations in flight instead of m. Interleaving v model chunks per stage
    divides the bubble *time* by v (`bubble_overhead`), at v times the p2p traffic. m < p leaves
    stages idle most of the time: the most common pipeline config error."""
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)


def _interleaved_in_flight(p: int, r: int, m: int, v: int) -> float:
    """(2(p-r-1) + (v-1)p + 1) chunk-micro-batches of L/(pv) layers, i.e. 1 + (p-1)/(pv) times
    1F1B's on the first stage (Korthikanti et al. 2022, section 4.2.3)."""
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as the estimator sees it: the idle fraction of a step, bubble(p, m, v),
    and the activations a stage holds at peak, in_flight(p, pp_rank, m, v), in units of one
    micro-batch through the stage's layers. A new schedule is one more `SCHEDULES` entry."""

    bubble: Callable[[int, int, int], float]
    in_flight: Callable[[int, int, int, int], float]


SCHEDULES: dict[str, Schedule] = {
    # GPipe: all m forwards, then all backwards: every micro-batch's activations at once.
    "gpipe": Schedule(lambda p, m, v: pipeline_bubble(p, m), lambda p, r, m, v: float(m)),
    # 1F1B: the same bubble, at most the warm-up depth p - r in flight (the point of 1F1B).
    "1f1b": Schedule(lambda p, m, v: pipeline_bubble(p, m), lambda p, r, m, v: float(min(m, p - r))),
    "interleaved": Schedule(pipeline_bubble, _interleaved_in_flight),
    # Zero-bubble schedules (Qi et al. 2024), at equal forward / input-gradient / weight-gradient costs
    # (t_F = t_B = t_W, a step's work per micro-batch 3 t_F); megalite.pipeline.simulate replays other costs.
    # ZB-H1: 1F1B's order with W deferred into the cool-down: idle (p-1)(t_F + t_B - t_W) = (p-1) t_F, a third of
    # 1F1B's; every rank holds up to p micro-batches (F until W).
    "zb-h1": Schedule(lambda p, m, v: (p - 1) / (3 * m + p - 1) if p > 1 else 0.0,
                      lambda p, r, m, v: float(min(m, p))),
    # ZB-V: two chunks per rank in a V; only the warm-up idles, (p-1)/2 forwards; 2p half-stage chunks in
    # flight, i.e. p micro-batches through the rank's layers.
    "zbv": Schedule(lambda p, m, v: (p - 1) / (6 * m + p - 1) if p > 1 else 0.0,
                    lambda p, r, m, v: float(min(m, p))),
}


def schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r} is unknown; use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def bubble_overhead(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time: (p-1)/(v·m). Exactly 1/v of the non-interleaved one."""
    return (p - 1) / (v * m) if p > 1 else 0.0


def microbatches_in_flight(layout: Layout, pp_rank: int, m: int) -> float:
    """Layers' worth of micro-batch activations a stage holds at peak, in units of its own layers
    (the schedule's entry in `SCHEDULES`)."""
    if layout.pp == 1:
        return 1.0  # gradient accumulation runs micro-batches one after another
    return schedule(layout.schedule).in_flight(layout.pp, pp_rank, m, layout.vpp)
