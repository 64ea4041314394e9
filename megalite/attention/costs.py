"""Closed forms of what a causal attention layer computes and keeps, full or sliding-window: torch-free, the one
home of these formulas (the cost model imports them; tests hold the kernels' and the ring's counts equal to them).

The window convention is variant.py's: query i sees key j iff i - W < j <= i (W keys counting its own); `window`
None (or >= the sequence) is full causal attention. Per head and sequence of S tokens:

    visible pairs      sum_i min(i + 1, W) = W (W + 1) / 2 + (S - W) W     (S (S + 1) / 2 when W >= S)
    dense pairs        S min(S, W): the "full" count (causal masking not halved; PaLM / Megatron `mfu`)
    forward FLOPs      4 d per pair (QK^T and PV, 2 FLOPs per multiply-add each); backward 2x that
    KV cache           min(S, W) positions: a windowed layer's cache never holds more than the window

so past the window a windowed layer's cost grows linearly in S, a full layer's quadratically.

Flash tiles (kernels/flash_attention.py): the forward walks, for each tile of `block_q` query rows, the key
tiles from the one holding key max(0, first row - W + 1) to the one holding the tile's last row; the dK/dV
backward walks, for each tile of `block_k` keys, the query tiles from the one holding its first key to the one
holding its last key + W - 1. Tiles outside those bounds hold no visible pair and are never loaded.

Ring blocks (megalite/context/ring.py): the zigzag split cuts S into 2 cp chunks of c = S / (2 cp) tokens; a
ring computes (query chunk, key chunk) pairs. Causality leaves cp (2 cp + 1) of the (2 cp)^2 pairs (2 cp + 1
per rank); a window also drops a pair whose nearest tokens are W or more apart, (a - b - 1) c + 1 >= W for query
chunk a and key chunk b < a: those are the skipped blocks (no FLOPs; their K/V still travel on around the ring,
later ranks may need them, so the bytes do not change).
"""

from __future__ import annotations

from dataclasses import dataclass


def _span(seq_len: int, window: int | None) -> int:
    """The keys a late query sees: min(S, W)."""
    if window is not None and window < 1:
        raise ValueError(f"attention window {window}: expected >= 1 (or None for full attention)")
    return seq_len if window is None else min(seq_len, window)


def visible_pairs(seq_len: int, window: int | None = None) -> int:
    """(query, key) pairs a causal layer of window `window` computes per head and sequence (module doc)."""
    w = _span(seq_len, window)
    return w * (w + 1) // 2 + (seq_len - w) * w


def dense_pairs(seq_len: int, window: int | None = None) -> int:
    """The full-count convention: S min(S, W) pairs (the masked half of a causal layer counted)."""
    return seq_len * _span(seq_len, window)


def attention_forward_flops(batch: int, seq_len: int, heads: int, head_dim: int, window: int | None = None,
                            causal_halved: bool = True) -> float:
    """Forward FLOPs of the score and value matmuls of one layer (`heads` of this rank): 4 d per pair, over the
    visible pairs (`causal_halved`: what is computed) or the dense ones (the full count). Backward: twice this."""
    pairs = visible_pairs(seq_len, window) if causal_halved else dense_pairs(seq_len, window)
    return 4.0 * batch * heads * head_dim * pairs


def kv_cache_positions(seq_len: int, window: int | None = None) -> int:
    """Positions a layer's KV cache must hold to decode the token after `seq_len` of them: min(S, W)."""
    return _span(seq_len, window)


def kv_cache_bytes(batch: int, seq_len: int, kv_heads: int, head_dim: int, elem_bytes: int,
                   window: int | None = None) -> int:
    """K and V of one layer's cache: 2 b min(S, W) hk d elements."""
    return 2 * batch * kv_cache_positions(seq_len, window) * kv_heads * head_dim * elem_bytes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flash_forward_tiles(seq_len: int, block_q: int, block_k: int, window: int | None = None) -> int:
    """(query tile, key tile) pairs the causal flash forward visits per (batch, head): module doc. The dQ backward
    walks the same bounds (its tiles swapped in size: pass its own block sizes)."""
    total = 0
    for start in range(0, seq_len, block_q):
        hi = min(start + block_q, seq_len)
        lo = 0 if window is None else max(0, start - window + 1) // block_k * block_k
        total += _cdiv(hi - lo, block_k)
    return total


def flash_dkdv_tiles(seq_len: int, block_q: int, block_k: int, window: int | None = None) -> int:
    """(key tile, query tile) pairs the causal flash dK/dV backward visits per (batch, query head)."""
    total = 0
    for start in range(0, seq_len, block_k):
        lo = start // block_q * block_q
        hi = seq_len if window is None else min(seq_len, start + block_k - 1 + window)
        total += _cdiv(hi - lo, block_q)
    return total


def chunk_pair_visible(query_chunk: int, key_chunk: int, chunk: int, window: int | None = None) -> bool:
    """Whether some query of chunk `query_chunk` sees some key of chunk `key_chunk` (chunks of `chunk` tokens in
    position order): causal (key chunk not after the query chunk), and the nearest pair inside the window."""
    if key_chunk > query_chunk:
        return False
    return window is None or key_chunk == query_chunk or (query_chunk - key_chunk - 1) * chunk + 1 < window


@dataclass(frozen=True)
class RingBlocks:
    """(query chunk, key chunk) pairs of c = S / (2 cp) tokens a zigzag ring computes and skips: module doc."""

    computed: int
    skipped: int


def ring_blocks(seq_len: int, cp: int, cp_rank: int, window: int | None = None) -> RingBlocks:
    """The chunk pairs rank `cp_rank` of a cp-rank zigzag ring computes and skips for one attention call (forward;
    the backward visits the same ones). Hybrid cp: its ring's length R = cp / a2a and its rank in that ring."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    c = seq_len // (2 * cp)
    computed = skipped = 0
    for a in (cp_rank, 2 * cp - 1 - cp_rank):
        for b in range(a + 1):
            if chunk_pair_visible(a, b, c, window):
                computed += 1
            else:
                skipped += 1
    return RingBlocks(computed, skipped)


def ring_blocks_total(seq_len: int, cp: int, window: int | None = None) -> RingBlocks:
    """`ring_blocks` summed over the cp ranks: cp (2 cp + 1) chunk pairs in all."""
    parts = [ring_blocks(seq_len, cp, r, window) for r in range(cp)]
    return RingBlocks(sum(p.computed for p in parts), sum(p.skipped for p in parts))
