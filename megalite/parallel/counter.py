"""The byte and call counter every megalite collective goes through.

Convention ("ring bytes", historically "wire bytes": what one rank sends when the collective runs as a ring,
the unit of the papers' formulas and of the estimator):

    all-reduce of X bytes over N ranks        2 (N-1)/N * X
    all-gather producing X bytes in total      (N-1)/N * X
    reduce-scatter consuming X bytes in total  (N-1)/N * X
    all-to-all of X bytes (this rank's input)  (N-1)/N * X   (the 1/N it keeps does not travel)
    point-to-point send of X bytes             X

so a DDP step over N ranks with Psi gradient elements of b bytes counts 2 (N-1)/N * Psi * b, the
ring all-reduce formula. Counts are kept as exact fractions summed per (group, op) and reported as floats; the
analytic tests compare against the same convention. The counter does not time anything.

The names bytes are filed under are a closed set (`CountKey`): each group kind's traffic under its own
name (the pipeline's two communicators both under "pp"), plus four names for traffic that rides on a
group but is not that group's step traffic, so that "dp" holds exactly the gradient reduction and "mp" the
gradient norm: "norm" (the norm's dp reduction under ZeRO), "metrics" (loss averaging, the stop flag),
"checkpoint" (ZeRO's gathers when saving) and "muon" (Muon's whole-matrix exchanges,
`megalite.optim.muon_exchange`). These strings are the keys of `comm_bytes` in metrics.jsonl.

This is an algorithmic count, not a measurement: metrics.jsonl says so in `comm_convention` (`COMM_CONVENTION`)
next to `comm_bytes`. A backend may move other amounts (gloo's reduce-scatter writes twice the count); what a
CPU process really wrote is measured separately, `comm_written_bytes` (`megalite.observability.wire`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from fractions import Fraction
from typing import Callable, Literal, cast, get_args

CountKey = Literal["tp", "dp", "pp", "mp", "embedding", "norm", "metrics", "checkpoint", "cp", "ep", "muon"]
COUNT_KEYS: frozenset[str] = frozenset(get_args(CountKey))
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"]
# The value of metrics.jsonl's `comm_convention`: the bytes in `comm_bytes` are the ring algorithm's per rank.
COMM_CONVENTION = "ring"


def check_count_key(key: str) -> CountKey:
    """`key` itself when it is a counter key; a ValueError naming the valid ones otherwise."""
    if key not in COUNT_KEYS:
        raise ValueError(f"unknown communication counter key {key!r}; expected one of {sorted(COUNT_KEYS)}")
    return cast(CountKey, key)


RING_FACTORS: dict[CollectiveOp, Callable[[int], Fraction]] = {
    "all_reduce": lambda n: Fraction(2 * (n - 1), n),
    "all_gather": lambda n: Fraction(n - 1, n),
    "reduce_scatter": lambda n: Fraction(n - 1, n),
    # `payload_bytes` of an all-to-all is what this rank sends to the *other* ranks (its own rows stay):
    # (n-1)/n of the tensor for equal chunks (Ulysses), the routed rows' bytes for MoE's variable splits.
    "all_to_all": lambda n: Fraction(1),
    "send": lambda n: Fraction(1),
}


class CommCounter:
    """Accumulates ring-convention bytes and calls per counter key ('tp', 'dp', 'pp', ..., see the module doc)."""

    def __init__(self) -> None:
        self._bytes: dict[CountKey, Fraction] = defaultdict(Fraction)
        self._calls: dict[CountKey, int] = defaultdict(int)
        self._by_op: dict[tuple[CountKey, CollectiveOp], Fraction] = defaultdict(Fraction)
        # Work counted beside the bytes, by name (e.g. the cp ring's computed / skipped attention blocks).
        self._tallies: dict[str, int] = defaultdict(int)
        # What this rank last entered (read by the hang watchdog): every collective passes here.
        self.last_op: str = "none yet"
        self.last_op_time: float = time.monotonic()

    def enter(self, description: str) -> None:
        """Note the operation this rank is about to block in (also used for uncounted receives)."""
        self.last_op, self.last_op_time = description, time.monotonic()

    def record(self, key: CountKey, op: CollectiveOp, payload_bytes: int, group_size: int) -> None:
        """Count one collective. `payload_bytes` is the full logical tensor (see module doc)."""
        check_count_key(key)
        if op not in RING_FACTORS:
            raise ValueError(f"unknown collective {op!r}; expected one of {sorted(RING_FACTORS)}")
        if group_size <= 1:
            return
        self.enter(f"{op} on group '{key}' ({payload_bytes} bytes)")
        wire = RING_FACTORS[op](group_size) * payload_bytes
        self._bytes[key] += wire
        self._by_op[(key, op)] += wire
        self._calls[key] += 1

    def tally(self, name: str, n: int) -> None:
        """Count `n` units of some work under `name` (not bytes: e.g. "cp_blocks_skipped", megalite/context/ring.py)."""
        self._tallies[name] += n

    def tallies(self) -> dict[str, int]:
        return dict(sorted(self._tallies.items()))

    def bytes(self) -> dict[str, float]:
        return {g: float(b) for g, b in sorted(self._bytes.items())}

    def exact_bytes(self, key: CountKey) -> Fraction:
        return self._bytes.get(check_count_key(key), Fraction(0))

    def calls(self) -> dict[str, int]:
        return dict(sorted(self._calls.items()))

    def by_op(self) -> dict[str, float]:
        return {f"{g}/{op}": float(b) for (g, op), b in sorted(self._by_op.items())}

    def exact_by_collective(self) -> dict[CollectiveOp, Fraction]:
        """Counted bytes per collective, summed over the keys (what a backend's own factors apply to)."""
        out: dict[CollectiveOp, Fraction] = defaultdict(Fraction)
        for (_, op), b in self._by_op.items():
            out[op] += b
        return dict(out)

    def total_calls(self) -> int:
        return sum(self._calls.values())

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()
        self._by_op.clear()
        self._tallies.clear()
