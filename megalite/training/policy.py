"""What a step's result means for the run: skipped steps (non-finite gradient norm) and loss spikes.

A skipped step leaves the parameters untouched (megalite.training.step); a few in a row are normal
under fp16 loss scaling, a long run of them means the run diverged and is stopped. A loss far above
the running median is logged (PaLM, Chowdhery et al. 2022, section 5.1, restarts from before such
spikes; megalite reports them and leaves the decision to the user).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from megalite.errors import MegaliteError
from megalite.training.step import StepResult

SPIKE_WINDOW = 100  # losses kept for the running median
SPIKE_WARMUP = 10   # no spike verdict before this many losses are known


class StepHealth:
    """Fed every step's result in order; `note` prints one line (rank 0's logger)."""

    def __init__(self, max_skipped_steps: int, spike_factor: float, note: Callable[[str], None]) -> None:
        self.max_skipped_steps, self.spike_factor, self.note = max_skipped_steps, spike_factor, note
        self.consecutive_skips = 0
        self.recent_losses: list[float] = []

    def check(self, step: int, result: StepResult) -> bool:
        """Note a skip or a spike at `step` (1-based); raise when the run diverged. True on a spike."""
        self.consecutive_skips = self.consecutive_skips + 1 if result.skipped else 0
        if self.consecutive_skips > self.max_skipped_steps:
            raise MegaliteError(f"{self.consecutive_skips} consecutive steps had a non-finite gradient norm (last at "
                                f"step {step}): the run is diverging; lower train.lr, use bf16 instead of fp16, or "
                                f"resume from an earlier checkpoint")
        spike = False
        if self.spike_factor > 0 and not result.skipped:
            if len(self.recent_losses) >= SPIKE_WARMUP:
                median = statistics.median(self.recent_losses)
                if result.loss > self.spike_factor * median:
                    spike = True
                    self.note(f"loss spike at step {step}: {result.loss:.4f} > {self.spike_factor:g} x running "
                              f"median {median:.4f}")
            self.recent_losses = (self.recent_losses + [result.loss])[-SPIKE_WINDOW:]
        if result.skipped:
            self.note(f"step {step} skipped: non-finite gradient norm ({self.consecutive_skips} in a row, "
                      f"limit train.max_skipped_steps={self.max_skipped_steps})")
        return spike
