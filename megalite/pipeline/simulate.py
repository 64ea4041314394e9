"""A timeline simulator for the pipeline schedules: the same action lists the engine runs, with a
forward of a whole stage taking t_f, an input-gradient backward t_b and a weight-gradient pass t_w
(a whole backward t_b + t_w; a chunk of a stage split into v chunks 1/v of each), communication
free. It answers "how much of the step is bubble?" exactly for the schedule as implemented, and
draws the timeline (`tools/pipeline_timeline.py`).

Bubble fraction = 1 - (useful compute per rank) / (step time) = 1 - M (t_f + t_b + t_w) / T.
Closed forms (with t = t_f + t_b + t_w):
  GPipe, 1F1B      T = (M + P - 1) t                     bubble (P-1)/(M+P-1)  (1F1B saves memory, not time)
  interleaved (v)  T = M t + (P - 1) t / v               bubble (P-1)/(v M + P - 1)
  ZB-H1            T = M t + (P - 1)(t_f + t_b - t_w)    (Qi et al. 2024; holds here for t_w <= t_b)
                   = (3M + P - 1) units at equal costs, i.e. (P-1)/(3M+P-1): a third of 1F1B's bubble time
  ZB-V             near M t for M >= 2P at equal costs (the paper gives no closed form; see the tests)
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.pipeline.schedules import Action, build_schedule, chunk_stages, split_backwards


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float
    split: bool = False  # a B that computes only the input gradient (its W is a separate event)


@dataclass(frozen=True)
class Timeline:
    events: list[Event]
    step_time: float
    bubble_fraction: float


def simulate(schedule: str, pp: int, num_micro: int, vpp: int = 1, t_f: float = 1.0, t_b: float = 1.0,
             t_w: float = 1.0) -> Timeline:
    lists = [build_schedule(schedule, num_micro, pp, r, vpp) for r in range(pp)]
    splits = [split_backwards(a) for a in lists]
    stage_of = [chunk_stages(schedule, r, pp, vpp) for r in range(pp)]
    stages = pp * vpp
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    free = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []

    def ready(rank: int, action: Action) -> float | None:
        """When the action's input is there (None: not yet produced)."""
        kind, m, c = action
        vs = stage_of[rank][c]
        if kind == "F":
            dep = ("F", m, vs - 1) if vs > 0 else None
        elif kind == "B":
            dep = ("B", m, vs + 1) if vs < stages - 1 else ("F", m, vs)
        else:
            dep = ("B", m, vs)
        return 0.0 if dep is None else done.get(dep)

    def cost(rank: int, action: Action) -> float:
        kind, m, c = action
        whole = {"F": t_f, "W": t_w, "B": t_b if (m, c) in splits[rank] else t_b + t_w}[kind]
        return whole / vpp

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
            end = start + cost(r, action)
            done[(action[0], action[1], stage_of[r][action[2]])] = end
            events.append(Event(r, action, start, end, action[0] == "B" and action[1:] in splits[r]))
            free[r], pos[r] = end, pos[r] + 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks at P={pp}, M={num_micro}, v={vpp}")
    step = max(free)
    return Timeline(events, step, 1.0 - num_micro * (t_f + t_b + t_w) / step)


def ascii_timeline(tl: Timeline, pp: int, width_per_unit: int = 2) -> str:
    """One row per rank: cells labelled by kind (F forward, b backward, w weight gradients) and
    micro-batch, '.' for idle."""
    unit = min(e.end - e.start for e in tl.events)
    cols = int(round(tl.step_time / unit))
    rows = []
    for r in range(pp):
        cells = ["." * width_per_unit] * cols
        for e in tl.events:
            if e.rank != r:
                continue
            label = f"{ {'F': 'F', 'B': 'b', 'W': 'w'}[e.action[0]]}{e.action[1]}"
            label = label[:width_per_unit].ljust(width_per_unit)
            for k in range(int(round(e.start / unit)), int(round(e.end / unit))):
                cells[k] = label
        rows.append(f"rank {r}: " + "".join(cells))
    return "\n".join(rows)
