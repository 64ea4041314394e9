"""Pipeline schedules as plain lists of actions per rank.

An action is ("F" or "B", micro_batch, chunk). Executing a rank's list in order, receiving inputs
when an action needs them and sending outputs asynchronously, runs the schedule (`engine.py`); the
same lists drive the timeline simulator (`simulate.py`), so what is simulated is what runs.

- GPipe (Huang et al. 2019): all M forwards, then all M backwards. Activations of M micro-batches
  are alive at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): warm-up of P-r-1 forwards on rank r, then
  alternate one forward / one backward, then cool-down backwards. The bubble is the SAME as GPipe's,
  (P-1)/(M+P-1) of the time (a common claim is that 1F1B halves it: it does not); what 1F1B changes
  is memory: at most P micro-batches in flight on the first stage instead of M.
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per rank; micro-batches enter in
  groups of P, each chunk in turn; the bubble becomes (P-1)/(v*M+P-1). Needs M % P == 0.
"""

from __future__ import annotations

from typing import Literal

Action = tuple[Literal["F", "B"], int, int]


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
    raise ValueError(f"unknown pipeline schedule {name!r}: expected 1f1b, gpipe or interleaved")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch activations held at once (forwards done whose backward has not run)."""
    live = peak = 0
    for kind, _, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
