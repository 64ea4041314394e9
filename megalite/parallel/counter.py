"""The byte and call counter every megalite collective goes through.

Convention ("wire bytes", what one rank sends with a ring algorithm, the unit of the papers' formulas):

    all-reduce of X bytes over N ranks        2 (N-1)/N * X
    all-gather producing X bytes in total      (N-1)/N * X
    reduce-scatter consuming X bytes in total  (N-1)/N * X
    point-to-point send of X bytes             X

so a DDP step over N ranks with Psi gradient elements of b bytes counts 2 (N-1)/N * Psi * b, the
ring all-reduce formula. Counts are kept as exact fractions summed per (group, op) and reported as floats; the
analytic tests compare against the same convention. The counter does not time anything.
"""

from __future__ import annotations

import time
from collections import defaultdict
from fractions import Fraction

RING_FACTORS = {
    "all_reduce": lambda n: Fraction(2 * (n - 1), n),
    "all_gather": lambda n: Fraction(n - 1, n),
    "reduce_scatter": lambda n: Fraction(n - 1, n),
    "send": lambda n: Fraction(1),
}


class CommCounter:
    """Accumulates wire bytes and calls per process-group name ('tp', 'dp', 'pp', ...)."""

    def __init__(self) -> None:
        self._bytes: dict[str, Fraction] = defaultdict(Fraction)
        self._calls: dict[str, int] = defaultdict(int)
        self._by_op: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        # What this rank last entered (read by the hang watchdog): every collective passes here.
        self.last_op: str = "none yet"
        self.last_op_time: float = time.monotonic()

    def enter(self, description: str) -> None:
        """Note the operation this rank is about to block in (also used for uncounted receives)."""
        self.last_op, self.last_op_time = description, time.monotonic()

    def record(self, group: str, op: str, payload_bytes: int, group_size: int) -> None:
        """Count one collective. `payload_bytes` is the full logical tensor (see module doc)."""
        if group_size <= 1:
            return
        self.enter(f"{op} on group '{group}' ({payload_bytes} bytes)")
        wire = RING_FACTORS[op](group_size) * payload_bytes
        self._bytes[group] += wire
        self._by_op[(group, op)] += wire
        self._calls[group] += 1

    def bytes(self) -> dict[str, float]:
        return {g: float(b) for g, b in sorted(self._bytes.items())}

    def exact_bytes(self, group: str) -> Fraction:
        return self._bytes.get(group, Fraction(0))

    def calls(self) -> dict[str, int]:
        return dict(sorted(self._calls.items()))

    def by_op(self) -> dict[str, float]:
        return {f"{g}/{op}": float(b) for (g, op), b in sorted(self._by_op.items())}

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()
        self._by_op.clear()
