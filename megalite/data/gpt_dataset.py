"""Training samples for a causal LM: documents -> shuffled stream -> fixed-length overlapping windows.

GPTDataset follows Megatron-LM's GPT dataset: the chosen documents (each already ending in EOD) are
shuffled with a seed and concatenated into one token stream, which is cut into samples of `seq_len + 1`
tokens. Sample i is `stream[i*seq_len : i*seq_len + seq_len + 1]`, so consecutive samples share one
token: the last label of sample i is the first input of sample i+1, and every token of the stream is
predicted exactly once. Samples cross document boundaries (no padding, no wasted compute); the EOD
token tells the model where a document ended.

BlendedDataset mixes several datasets with weights using Megatron's greedy rule: sample j comes from
the dataset whose count lags its target `weight * (j+1)` the most, so every prefix of the blend tracks
the weights within one sample per dataset.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megalite.data.indexed import IndexedDataset
from megalite.errors import ConfigError, DataError


class GPTDataset:
    """Samples of `seq_len + 1` token ids (int64) over a seeded shuffle of `doc_indices` of `indexed`."""

    def __init__(self, indexed: IndexedDataset, doc_indices: np.ndarray, seq_len: int, seed: int,
                 name: str = "dataset") -> None:
        if seq_len < 1:
            raise ConfigError(f"model.seq_len must be >= 1, got {seq_len}")
        doc_indices = np.asarray(doc_indices, dtype=np.int64)
        if doc_indices.size == 0:
            raise DataError(f"{name} split of {indexed.prefix!r} has no documents: use more documents or change "
                            "data.valid_fraction")
        self.indexed, self.seq_len, self.seed, self.name = indexed, int(seq_len), int(seed), name
        self.doc_order: np.ndarray = np.random.default_rng(seed).permutation(doc_indices)
        lengths = indexed.doc_lengths[self.doc_order]
        # doc_starts[k] = position in the concatenated stream where the k-th shuffled document begins.
        self.doc_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.doc_starts[1:])
        total = int(self.doc_starts[-1])
        if total < seq_len + 1:
            raise DataError(f"{name} split of {indexed.prefix!r} has {total} tokens, but one sample of "
                            f"model.seq_len={seq_len} needs {seq_len + 1}: use more data, a smaller model.seq_len"
                            " or (for the validation split) a larger data.valid_fraction")
        self.num_tokens = total
        # The last sample must end inside the stream: i*S + S + 1 <= total.
        num_samples = (total - 1) // seq_len
        sample_starts = np.arange(num_samples, dtype=np.int64) * seq_len
        # side="right" - 1: the last document starting at or before the position; empty documents (which
        # share a start with their successor) are skipped automatically.
        self.sample_doc: np.ndarray = np.searchsorted(self.doc_starts, sample_starts, side="right") - 1
        self.sample_offset: np.ndarray = sample_starts - self.doc_starts[self.sample_doc]

    def __len__(self) -> int:
        return len(self.sample_doc)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        k, offset = int(self.sample_doc[i]), int(self.sample_offset[i])
        need = self.seq_len + 1
        pieces: list[np.ndarray] = []
        while need > 0:
            piece = self.indexed.get(int(self.doc_order[k]), offset, need)
            pieces.append(piece)
            need -= len(piece)
            k, offset = k + 1, 0
        sample = np.concatenate(pieces)
        self.indexed.check_sample_ids(sample)  # a no-op where the whole file was scanned at open
        return sample.astype(np.int64)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name}, docs={len(self.doc_order)}, tokens={self.num_tokens}, "
                f"samples={len(self)}, seq_len={self.seq_len})")


class BlendedDataset:
    """A weighted, deterministic interleave of datasets; length = the sum of their lengths.

    Member sample counters wrap modulo the member's length, so a heavily weighted small dataset is
    repeated (upsampled) and a lightly weighted large one is only partly seen.
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float]) -> None:
        if not datasets:
            raise ConfigError("BlendedDataset needs at least one dataset: set data.path")
        if len(weights) != len(datasets):
            raise ConfigError(f"data.weights has {len(weights)} entries for {len(datasets)} datasets in "
                              "data.path: give one weight per dataset (or none for size-proportional)")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
            raise ConfigError(f"data.weights must be finite, >= 0 and not all zero, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights: np.ndarray = w / w.sum()
        self.dataset_index, self.dataset_sample_index = self._build_index(
            self.weights, sum(len(d) for d in datasets))

    @staticmethod
    def _build_index(weights: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's greedy blend: pick argmax_i(weight_i * (j+1) - count_i), ties to the lower i.

        A plain loop: the rule is sequential (each choice depends on all previous ones). It runs at
        about a microsecond per sample per dataset, once, when the data is built.
        """
        w = [float(x) for x in weights]
        k = len(w)
        counts = [0] * k
        which = np.empty(n, dtype=np.int32)
        local = np.empty(n, dtype=np.int64)
        for j in range(n):
            t = j + 1
            best, best_err = 0, w[0] * t - counts[0]
            for i in range(1, k):
                err = w[i] * t - counts[i]
                if err > best_err:
                    best, best_err = i, err
            which[j] = best
            local[j] = counts[best]
            counts[best] += 1
        return which, local

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, j: int) -> np.ndarray:
        d = self.datasets[int(self.dataset_index[j])]
        return d[int(self.dataset_sample_index[j]) % len(d)]

    def __repr__(self) -> str:
        return f"BlendedDataset(samples={len(self)}, weights={np.round(self.weights, 4).tolist()})"


def split_documents(num_docs: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of document ids into (train, valid), both sorted; valid gets round(fraction * num_docs).

    Splitting by document (not by sample) keeps validation text unseen in training. At least one
    document goes to each side when `valid_fraction > 0`.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction must be in [0, 1), got {valid_fraction}")
    if num_docs < 1:
        raise DataError("the dataset has no documents")
    all_docs = np.arange(num_docs, dtype=np.int64)
    if valid_fraction == 0.0:
        return all_docs, np.empty(0, dtype=np.int64)
    if num_docs < 2:
        raise DataError(f"cannot hold out validation documents from a dataset of {num_docs} document: set "
                        "data.valid_fraction=0, or preprocess with --split-paragraphs / more files")
    n_valid = min(max(1, round(num_docs * valid_fraction)), num_docs - 1)
    perm = np.random.default_rng(seed).permutation(num_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])
