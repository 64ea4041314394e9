"""A resumable, data-parallel-aware sampler: which dataset samples each rank reads at each step.

The global sample order is a stream over epochs: epoch e is a permutation of `range(dataset_len)` seeded
with `seed + e`, and the stream runs from one epoch into the next without a break. Optimizer step s
consumes stream positions `[s*G, (s+1)*G)` (G = global batch size); data-parallel rank r takes the
contiguous slice `[r*G/dp, (r+1)*G/dp)` of it and cuts it into micro-batches.

Consequences that the tests hold us to:
  * the *set* of samples in a step does not depend on the number of DP ranks, so a run at dp=4
    computes the same gradient (a mean over the same samples) as at dp=1;
  * the position of any sample is `consumed_samples + k`, so resuming from a checkpoint jumps there
    in O(1) (one permutation per touched epoch, cached) and continues exactly, even if the global
    batch size or dp changed in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from megalite.context.zigzag import zigzag_split
from megalite.errors import ConfigError, DataError


class SampleSource(Protocol):
    """Anything indexable that returns 1-D token arrays of one length (GPTDataset, BlendedDataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class DataSampler:
    """Yields, per optimizer step, this DP rank's micro-batches of dataset indices."""

    extra_key: ClassVar[str] = "sampler"  # its entry in a checkpoint's extra state

    def __init__(self, dataset_len: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, consumed_samples: int = 0) -> None:
        if dataset_len < 1:
            raise DataError("the training dataset has no samples: use more data or a smaller model.seq_len")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"bad data-parallel rank {dp_rank} of {dp_size}")
        if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(f"train.global_batch_size={global_batch_size} must be a positive multiple of "
                              f"train.micro_batch_size * dp = {micro_batch_size} * {dp_size}")
        if global_batch_size < 1:
            raise ConfigError(f"train.global_batch_size must be >= 1, got {global_batch_size}")
        if consumed_samples < 0:
            raise ConfigError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset_len, self.seed = int(dataset_len), int(seed)
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.consumed_samples = int(consumed_samples)
        self._perm_cache: dict[int, np.ndarray] = {}

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient-accumulation steps: G / (dp * micro_batch_size)."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            # A step spans at most two epochs unless G > dataset_len: keep a couple, drop older ones.
            for old in [e for e in self._perm_cache if e < epoch - 1]:
                del self._perm_cache[old]
            perm = np.random.default_rng(self.seed + epoch).permutation(self.dataset_len)
            self._perm_cache[epoch] = perm
        return perm

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices at absolute stream positions (any epochs)."""
        epochs, within = np.divmod(positions, self.dataset_len)
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._permutation(int(e))[within[mask]]
        return out

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step; advances `consumed_samples` by G."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        idx = self.indices_at(np.arange(start, start + per_rank, dtype=np.int64)).tolist()
        self.consumed_samples += self.global_batch_size
        m = self.micro_batch_size
        return [idx[i: i + m] for i in range(0, per_rank, m)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "dataset_len": self.dataset_len}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Resume at `d["consumed_samples"]`; the order must be the same, so seed and length must match."""
        if int(d.get("dataset_len", self.dataset_len)) != self.dataset_len:
            raise DataError(f"the checkpoint's data had {d['dataset_len']} training samples, this run has "
                            f"{self.dataset_len}: resuming would not continue the same order; use the same "
                            "data.path, data.valid_fraction and model.seq_len as the checkpointed run")
        if int(d.get("seed", self.seed)) != self.seed:
            raise DataError(f"the checkpoint's data order used seed {d['seed']}, this run uses {self.seed}: "
                            "set train.seed to the checkpointed run's seed to resume")
        self.consumed_samples = int(d["consumed_samples"])


def make_batch(dataset: SampleSource, indices: Sequence[int], cp: int = 1,
               cp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples of `seq_len + 1` tokens into (input_ids[B, S], labels[B, S]), both int64.

    Labels are the inputs shifted by one: position t predicts token t+1 (next-token prediction).
    Context parallelism (cp > 1): every cp rank of a ring reads the same samples (the sampler is indexed
    by the dp rank) and keeps its zigzag split of inputs and labels alike, [B, S/cp] each, here, once.
    """
    x = torch.from_numpy(np.stack([np.asarray(dataset[int(i)], dtype=np.int64) for i in indices]))
    return cp_split(x[:, :-1], cp, cp_rank), cp_split(x[:, 1:], cp, cp_rank)


def cp_split(tokens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This context-parallel rank's zigzag split of [B, S] tokens (the tokens themselves at cp = 1)."""
    return (zigzag_split(tokens, cp, cp_rank) if cp > 1 else tokens).contiguous()
