"""What this process really wrote to its sockets: the measured counterpart of the counted comm bytes.

`CommCounter` counts each collective by the ring algorithm's formula (`megalite.parallel.counter`): the unit
of the papers and of the estimator. What a backend puts on the wire can differ. On CPU the kernel keeps, per
process, the bytes it passed to write(2) and writev(2): `wchar` in `/proc/self/io` (all threads summed, so gloo's
own I/O threads are included). gloo's TCP transport sends with writev, so during a training step, where
nothing else writes, the growth of `wchar` is what this rank wrote to its peers, framing included.
`/proc/net/dev`'s loopback counters would not do: they add up every process of the machine.

Measured with gloo (torch 2.13, `tests/test_wire_bytes.py` holds it), per rank, for a payload of X bytes over
N ranks: all-reduce writes 2(N-1)/N X and all-gather (N-1)/N X, as counted; a point-to-point send writes X at
the sender and nothing at the receiver, as counted; but reduce-scatter writes 2(N-1)/N X, twice the counted
(N-1)/N X: gloo reduces the whole tensor (an all-reduce's traffic) and keeps one chunk. Each call adds a few
hundred bytes of message headers per peer. NCCL moves bytes over NVLink/InfiniBand without a system call, so
on CUDA nothing here can be measured (`None`).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Mapping

from megalite.parallel.counter import CollectiveOp

PROC_IO = Path("/proc/self/io")

# Bytes a rank writes on gloo per byte the counter counts, per collective (measured; see the module doc).
GLOO_WRITTEN_PER_COUNTED: dict[CollectiveOp, Fraction] = {
    "all_reduce": Fraction(1), "all_gather": Fraction(1), "reduce_scatter": Fraction(2), "send": Fraction(1),
    "all_to_all": Fraction(1)}

# gloo's per-call framing, measured at N <= 4: at most ~7 KB for a reduce-scatter over 4 ranks (its many
# small messages), ~0.6 KB per peer for an all-reduce. A bound per counted call, for comparisons.
GLOO_FRAMING_BYTES_PER_CALL = 8 * 1024


def process_written_bytes() -> int | None:
    """Bytes this process has passed to write(2)/writev(2) since it started (`wchar`); None off Linux."""
    try:
        for line in PROC_IO.read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def measurable(device_type: str) -> bool:
    """Whether written bytes mean wire bytes here: CPU collectives (gloo over TCP) on Linux."""
    return device_type == "cpu" and process_written_bytes() is not None


class WrittenBytes:
    """Bytes written between `start()` and `stop()`; None where not measurable (see `measurable`)."""

    def __init__(self, device_type: str) -> None:
        self.enabled = measurable(device_type)
        self._start: int | None = None

    def start(self) -> None:
        self._start = process_written_bytes() if self.enabled else None

    def stop(self) -> int | None:
        end = process_written_bytes() if self._start is not None else None
        return None if end is None or self._start is None else end - self._start


def expected_gloo_written(counted_by_op: Mapping[CollectiveOp, Fraction]) -> Fraction:
    """What a rank writes on gloo for the counted bytes per collective (framing left out)."""
    return sum((GLOO_WRITTEN_PER_COUNTED[op] * b for op, b in counted_by_op.items()), Fraction(0))
