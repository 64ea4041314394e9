"""Closed forms of the bytes the context-parallel attention forms move, per rank per attention call.

In the counter's convention (megalite/parallel/counter.py: what one rank sends). `kv` is the number of
elements of this rank's K and V together, 2 b (S/cp) hk d; `elem_bytes` is their element size (K/V travel
in the compute dtype); gradient partials travel in fp32 (4 bytes) in both forms so that their sums over the
cp ranks do not lose bits in bf16.

    ring        forward (cp-1) kv e     backward (cp-1) kv (e + 4)
    all-gather  forward (cp-1) kv e     backward (cp-1) kv 4

tests/test_context_parallel.py holds the counter equal to these.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAD_BYTES = 4


@dataclass(frozen=True)
class CpBytes:
    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def local_kv_elements(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int) -> int:
    """Elements of one rank's K and V together (seq_len is the full sequence)."""
    return 2 * batch * (seq_len // cp) * kv_heads * head_dim


def ring_attention_bytes(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int,
                         elem_bytes: int) -> CpBytes:
    kv = local_kv_elements(batch, seq_len, kv_heads, head_dim, cp)
    return CpBytes((cp - 1) * kv * elem_bytes, (cp - 1) * kv * (elem_bytes + GRAD_BYTES))


def allgather_attention_bytes(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int,
                              elem_bytes: int) -> CpBytes:
    kv = local_kv_elements(batch, seq_len, kv_heads, head_dim, cp)
    return CpBytes((cp - 1) * kv * elem_bytes, (cp - 1) * kv * GRAD_BYTES)
