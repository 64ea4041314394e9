"""The zigzag sequence split: causal load balancing for context parallelism.

A sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp) tokens; context-parallel rank r holds
chunks r and 2·cp-1-r, concatenated in that order (so its local tokens are still in increasing position
order). Under a causal mask the work of a query chunk grows with its index; pairing an early chunk with
the mirrored late one gives every rank the same number of (query, key) pairs, where a contiguous split
would leave the last rank with 2·cp-1 times the first rank's work. Example, S = 8, cp = 2, c = 2:

    positions   0 1 | 2 3 | 4 5 | 6 7
    chunk         0     1     2     3
    rank 0 holds chunks 0, 3 -> positions 0 1 6 7
    rank 1 holds chunks 1, 2 -> positions 2 3 4 5

Everything here is pure indexing (no communication).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megalite.errors import ConfigError


def check_zigzag(seq_len: int, cp: int) -> None:
    """A ConfigError unless `seq_len` splits into 2·cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"context parallel size must be >= 1, got {cp}")
    if seq_len % (2 * cp):
        raise ConfigError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp} (the zigzag split "
                          f"gives each cp rank two equal chunks); pick a multiple of {2 * cp}")


def zigzag_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (out of 2·cp) that context-parallel rank `cp_rank` holds."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} outside [0, {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (int64, length seq_len / cp) of this rank's tokens, in local order: index RoPE's
    cos/sin tables (or learned position embeddings) with them."""
    check_zigzag(seq_len, cp)
    c = seq_len // (2 * cp)
    first, second = zigzag_chunks(cp, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def zigzag_split(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of the full-sequence tensor `x` ([b, s, ...] with dim=1), concatenated."""
    check_zigzag(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = zigzag_chunks(cp, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_merge(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Undo `zigzag_split`: the full sequence from every rank's local tensor, `parts[r]` from cp rank r."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.shape[dim] % 2:
            raise ValueError(f"zigzag_merge: part {rank} has odd length {part.shape[dim]} along dim {dim}")
        first, second = zigzag_chunks(cp, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat([c for c in chunks if c is not None], dim=dim)
