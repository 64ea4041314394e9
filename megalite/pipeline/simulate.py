"""A timeline simulator for the pipeline schedules: the same action lists the engine runs, with a
forward of a whole stage taking t_f and a backward t_b (a chunk of an interleaved stage 1/v of
that), communication free. It answers "how much of the step is bubble?" exactly for the schedule as
implemented, and draws the timeline (`tools/pipeline_timeline.py`).

Bubble fraction = 1 - (useful compute per rank) / (step time) = 1 - M (t_f + t_b) / T. For GPipe and
1F1B T = (M + P - 1)(t_f + t_b), so the bubble is (P-1)/(M+P-1) for both (1F1B saves memory, not
time); interleaved with v chunks gives T = M(t_f + t_b) + (P-1)(t_f + t_b)/v, i.e. (P-1)/(v M + P - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.pipeline.schedules import Action, build_schedule


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    events: list[Event]
    step_time: float
    bubble_fraction: float


def simulate(schedule: str, pp: int, num_micro: int, vpp: int = 1, t_f: float = 1.0, t_b: float = 2.0) -> Timeline:
    lists = [build_schedule(schedule, num_micro, pp, r, vpp) for r in range(pp)]
    stages = pp * vpp
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    free = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []

    def ready(rank: int, action: Action) -> float | None:
        kind, m, c = action
        vs = c * pp + rank
        if kind == "F":
            dep = ("F", m, vs - 1) if vs > 0 else None
        else:
            dep = ("B", m, vs + 1) if vs < stages - 1 else ("F", m, vs)
        if dep is None:
            return 0.0
        return done.get(dep)

    remaining = sum(len(a) for a in lists)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] >= len(lists[r]):
                continue
            action = lists[r][pos[r]]
            t_dep = ready(r, action)
            if t_dep is None:
                continue
            start = max(free[r], t_dep)
            end = start + (t_f if action[0] == "F" else t_b) / vpp
            done[(action[0], action[1], action[2] * pp + r)] = end
            events.append(Event(r, action, start, end))
            free[r], pos[r] = end, pos[r] + 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks at P={pp}, M={num_micro}, v={vpp}")
    step = max(free)
    return Timeline(events, step, 1.0 - num_micro * (t_f + t_b) / step)


def ascii_timeline(tl: Timeline, pp: int, width_per_unit: int = 2) -> str:
    """One row per rank: F/B cells labelled by micro-batch, '.' for idle."""
    unit = min(e.end - e.start for e in tl.events)
    cols = int(round(tl.step_time / unit))
    rows = []
    for r in range(pp):
        cells = ["." * width_per_unit] * cols
        for e in tl.events:
            if e.rank != r:
                continue
            label = f"{'F' if e.action[0] == 'F' else 'b'}{e.action[1]}"[:width_per_unit].ljust(width_per_unit)
            for k in range(int(round(e.start / unit)), int(round(e.end / unit))):
                cells[k] = label
        rows.append(f"rank {r}: " + "".join(cells))
    return "\n".join(rows)
