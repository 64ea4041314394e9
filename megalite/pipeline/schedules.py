"""Pipeline schedules as plain lists of actions per rank.

An action is (kind, micro_batch, chunk) with kind "F" (forward), "B" (backward) or "W" (weight
gradients). A "B" whose (micro_batch, chunk) also has a "W" in the list computes only the gradient
with respect to the stage input (the part on the critical path); that "W" later computes the weight
gradients of the linears. A "B" without a "W" is the whole backward (input and weight gradients).
Executing a rank's list in order, receiving inputs when an action needs them and sending outputs
asynchronously, runs the schedule (`engine.py`); the same lists drive the timeline simulator
(`simulate.py`), so what is simulated is what runs.

- GPipe (Huang et al. 2019): all M forwards, then all M backwards. Activations of M micro-batches
  are alive at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): warm-up of P-r-1 forwards on rank r, then
  alternate one forward / one backward, then cool-down backwards. The bubble is the SAME as GPipe's,
  (P-1)/(M+P-1) of the time (a common claim is that 1F1B halves it: it does not); what 1F1B changes
  is memory: at most P micro-batches in flight on the first stage instead of M.
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per rank; micro-batches enter in
  groups of P, each chunk in turn; the bubble becomes (P-1)/(v*M+P-1). Needs M % P == 0.
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): each backward split into B and W.
  Rank r runs 1F1B's order with its W's deferred by r positions (the last stage defers most), so in
  the cool-down the B's run back to back along the critical path and the W's fill what was bubble.
  Bubble (P-1)(T_F + T_B - T_W) instead of 1F1B's (P-1)(T_F + T_B + T_W): a third at equal costs.
  Peak activations: P micro-batches in flight (F until W) on every rank, 1F1B's peak (its first
  stage's); later stages hold more than under 1F1B, up to that same peak.
- ZB-V (Qi et al. 2024, section 6): 2 chunks per rank placed in a V (rank r holds virtual stages r
  and 2P-1-r, so the first and the last stage, and the loss, share rank 0), the activation memory of
  1F1B's first stage on every rank (2P half-stage chunks in flight) and a bubble that does not grow
  with M: only the warm-up, (P-1)/2 stage-forwards for P <= 8 (the least possible: the last rank
  waits that long for its first input), a little more beyond. The list comes from a greedy
  replay at unit cost (`_zero_bubble_v`): whenever a rank is free it runs a ready B, else a ready F
  that fits the memory bound, else its oldest pending W. Unit costs only fix the order; the lists
  are valid (deadlock-free, exact gradients) for any real costs, and `simulate.py` measures them:
  the order is tuned for t_f = t_b = t_w, and with costs far from equal (say t_b = 2 t_f) it can
  idle as much as 1F1B; ZB-H1's order keeps its closed form for any t_w <= t_b.
"""

from __future__ import annotations

import functools
from typing import Literal

from megalite.pipeline.partition import chunk_virtual_stages

Kind = Literal["F", "B", "W"]
Action = tuple[Kind, int, int]

ZERO_BUBBLE = ("zb-h1", "zbv")
SCHEDULES = ("1f1b", "gpipe", "interleaved") + ZERO_BUBBLE
# What each schedule fixes of the layout, the one place these rules live (config validation, the pipeline
# builder and `build_schedule` all ask `layout_problems`): chunks per rank (None = any vpp > 1), whether
# the chunks sit in a V (rank r: stages r and 2P-1-r), whether it needs pp > 1. A new schedule is a row
# here, its action list above, and its row in the cost model (megalite/perfmodel/schedules.py).
CHUNKS: dict[str, int | None] = {"1f1b": 1, "gpipe": 1, "interleaved": None, "zb-h1": 1, "zbv": 2}
V_SHAPED: frozenset[str] = frozenset({"zbv"})
NEEDS_PP: frozenset[str] = frozenset({"interleaved", "zb-h1", "zbv"})
assert set(CHUNKS) == set(SCHEDULES)


def layout_problems(name: str, pp: int, vpp: int) -> list[str]:
    """Why schedule `name` cannot run `vpp` chunks per rank on `pp` stages (empty: it can), one line each."""
    out: list[str] = []
    chunks = CHUNKS[name]
    if vpp > 1 and chunks == 1:
        out.append(f"parallel.vpp={vpp} needs parallel.schedule=interleaved or zbv (got {name})")
    if name in NEEDS_PP and name in ZERO_BUBBLE and pp == 1:
        out.append(f"parallel.schedule={name} needs parallel.pp > 1 (it fills the pipeline's bubble)")
    if name in ZERO_BUBBLE and chunks != vpp:
        out.append(f"parallel.schedule={name} runs one chunk per rank: set parallel.vpp=1 (got {vpp}), or use zbv "
                   "for two" if chunks == 1 else
                   f"parallel.schedule={name} places exactly {chunks} chunks per rank in a V: set "
                   f"parallel.vpp={chunks} (got {vpp})")
    if chunks is None and vpp == 1:
        out.append(f"parallel.schedule={name} needs parallel.vpp > 1 (virtual chunks per rank)")
    if name in NEEDS_PP and name not in ZERO_BUBBLE and pp == 1:
        out.append(f"parallel.schedule={name} needs parallel.pp > 1")
    return out


def gpipe(num_micro: int, pp: int, pp_rank: int) -> list[Action]:
    return [("F", m, 0) for m in range(num_micro)] + [("B", m, 0) for m in range(num_micro)]


def one_f_one_b(num_micro: int, pp: int, pp_rank: int) -> list[Action]:
    warmup = min(pp - pp_rank - 1, num_micro)
    actions: list[Action] = [("F", m, 0) for m in range(warmup)]
    # Steady state: forward micro-batch warmup+i, then backward micro-batch i.
    for i in range(num_micro - warmup):
        actions += [("F", warmup + i, 0), ("B", i, 0)]
    actions += [("B", m, 0) for m in range(num_micro - warmup, num_micro)]  # cool-down
    return actions


def interleaved(num_micro: int, pp: int, pp_rank: int, vpp: int) -> list[Action]:
    """Megatron's interleaved order. The k-th forward of a rank is micro-batch
    (k // (P*v)) * P + k % P on chunk (k // P) % v; the k-th backward walks the chunks in reverse."""
    if num_micro % pp:
        raise ValueError(f"interleaved schedule needs micro-batches ({num_micro}) divisible by pp ({pp})")
    total = num_micro * vpp

    def fwd(k: int) -> Action:
        return ("F", (k // (pp * vpp)) * pp + k % pp, (k // pp) % vpp)

    def bwd(k: int) -> Action:
        return ("B", (k // (pp * vpp)) * pp + k % pp, vpp - 1 - (k // pp) % vpp)

    warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    actions = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [fwd(warmup + i), bwd(i)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


def zb_h1(num_micro: int, pp: int, pp_rank: int) -> list[Action]:
    """1F1B with split backwards, rank r's W's deferred by r places (see the module doc)."""
    warmup = min(pp - pp_rank - 1, num_micro)
    actions: list[Action] = [("F", m, 0) for m in range(warmup)]
    next_w = 0
    for k in range(num_micro):
        if warmup + k < num_micro:
            actions.append(("F", warmup + k, 0))
        actions.append(("B", k, 0))
        if k >= pp_rank:
            actions.append(("W", next_w, 0))
            next_w += 1
    return actions + [("W", m, 0) for m in range(next_w, num_micro)]


@functools.lru_cache(maxsize=64)  # every rank and every step asks for the same lists
def _zero_bubble_v(num_micro: int, pp: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V list, from a greedy replay at unit cost (see the module doc).

    Memory bound: 1F1B's peak, P whole stages = 2P half-stage chunk activations, on every rank; a
    forward starts only while the rank holds fewer, and its W frees the slot. That greedy could in
    principle fill a rank with first-chunk activations whose second chunk then finds no room (it
    does not for any P <= 16: tests/test_zero_bubble.py); if it ever did, the replay is redone with
    each entering micro-batch reserving both its slots up front, which cannot get stuck (the second
    chunk always has its slot) but idles more in the warm-up."""
    try:
        return _greedy_v(num_micro, pp, reserve=False)
    except _Stuck:
        return _greedy_v(num_micro, pp, reserve=True)


class _Stuck(Exception):
    pass


def _greedy_v(num_micro: int, pp: int, reserve: bool) -> tuple[tuple[Action, ...], ...]:
    stages = [chunk_virtual_stages(r, pp, 2, v_shape=True) for r in range(pp)]
    n_stages, limit = 2 * pp, 2 * pp
    done: set[tuple[Kind, int, int]] = set()  # (kind, micro, virtual stage), finished by the current tick
    lists: list[list[Action]] = [[] for _ in range(pp)]
    used = [0] * pp                            # memory slots taken (or reserved) per rank
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (micro, chunk), oldest first
    next_entry = [0] * pp                      # the next micro-batch to enter the rank's first chunk
    total = 3 * num_micro * n_stages
    while sum(len(a) for a in lists) < total:
        started: list[tuple[Kind, int, int]] = []
        for r in range(pp):
            room = (used[r] + 2 <= limit, True) if reserve else (used[r] < limit, used[r] < limit)
            action = _pick(stages[r], n_stages, num_micro, done, room, next_entry[r], pending_w[r])
            if action is None:
                continue
            kind, m, c = action
            lists[r].append(action)
            if kind == "F":
                used[r] += (2 if c == 0 else 0) if reserve else 1
                next_entry[r] += c == 0
            elif kind == "B":
                pending_w[r].append((m, c))
            else:
                pending_w[r].remove((m, c))
                used[r] -= 1
            started.append((kind, m, stages[r][c]))
        if not started:
            raise _Stuck()
        done.update(started)
    return tuple(tuple(a) for a in lists)


def _pick(stages: list[int], n_stages: int, num_micro: int, done: set[tuple[Kind, int, int]],
          room: tuple[bool, bool], entry: int, pending_w: list[tuple[int, int]]) -> Action | None:
    """One rank's choice at a tick: a ready B (oldest micro-batch, deepest chunk), else a ready F
    that has room (deepest chunk first: micro-batches already inside go before a new one enters),
    else its oldest pending W."""
    backwards = []
    for c, vs in enumerate(stages):
        for m in range(num_micro):
            if ("B", m, vs) in done or ("F", m, vs) not in done:
                continue
            dep = ("F", m, vs) if vs == n_stages - 1 else ("B", m, vs + 1)
            if dep in done:
                backwards.append((m, -vs, c))
    if backwards:
        m, _, c = min(backwards)
        return ("B", m, c)
    for c in reversed(range(len(stages))):
        vs = stages[c]
        for m in range(num_micro):
            if ("F", m, vs) in done:
                continue
            if not room[c] or (c == 0 and m != entry):
                break
            if vs == 0 or ("F", m, vs - 1) in done:
                return ("F", m, c)
            break  # forwards of one chunk run in micro-batch order
    if pending_w:
        m, c = pending_w[0]
        return ("W", m, c)
    return None


def build_schedule(name: str, num_micro: int, pp: int, pp_rank: int, vpp: int = 1) -> list[Action]:
    """The action list of one rank; pp=1 (any name) is plain gradient accumulation."""
    if pp == 1 and vpp == 1:
        return gpipe(num_micro, 1, 0) if name == "gpipe" else one_f_one_b(num_micro, 1, 0)
    if name == "gpipe":
        return gpipe(num_micro, pp, pp_rank)
    if name == "1f1b":
        return one_f_one_b(num_micro, pp, pp_rank)
    if name == "interleaved":
        return interleaved(num_micro, pp, pp_rank, vpp)
    if name == "zb-h1":
        return zb_h1(num_micro, pp, pp_rank)
    if name == "zbv":
        if problems := layout_problems(name, pp, vpp):
            raise ValueError("; ".join(problems))
        return list(_zero_bubble_v(num_micro, pp)[pp_rank])
    raise ValueError(f"unknown pipeline schedule {name!r}: expected one of {', '.join(SCHEDULES)}")


def chunk_stages(name: str, pp_rank: int, pp: int, vpp: int) -> list[int]:
    """The virtual stage of each of the rank's chunks: V-shaped for zbv, else r, r+P, r+2P, ..."""
    return chunk_virtual_stages(pp_rank, pp, vpp, v_shape=name in V_SHAPED)


def split_backwards(actions: list[Action]) -> set[tuple[int, int]]:
    """The (micro_batch, chunk) pairs whose backward is split into B (input grad) and W."""
    return {(m, c) for kind, m, c in actions if kind == "W"}


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch activations held at once: from F until its backward, or until its W when the
    backward is split (a deferred W still holds the linears' inputs and output gradients)."""
    split = split_backwards(actions)
    live = peak = 0
    for kind, m, c in actions:
        if kind == "F":
            live += 1
        elif kind == "W" or (m, c) not in split:
            live -= 1
        peak = max(peak, live)
    return peak
