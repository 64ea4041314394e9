"""Closed forms of the bytes the context-parallel attention forms move, per rank per attention call.

In the counter's convention (megalite/parallel/counter.py: what one rank sends). `kv` is the number of
elements of this rank's K and V together, 2 b (S/cp) hk d; `elem_bytes` is their element size (K/V travel
in the compute dtype); gradient partials travel in fp32 (4 bytes) in both forms so that their sums over the
cp ranks do not lose bits in bf16.

    ring        forward (cp-1) kv e     backward (cp-1) kv (e + 4)
    all-gather  forward (cp-1) kv e     backward (cp-1) kv 4
    a2a         forward (cp-1)/cp t (2 hq + 2 hk) e = backward, t = b (S/cp) d  (q, k, v out; the output back)
    hybrid      the a2a's over a2a ranks + the ring's over R = cp/a2a ranks with hk/a2a heads (hybrid.py)

tests/test_context_parallel.py holds the counter equal to these.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.context.options import ContextOptions

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


def a2a_attention_bytes(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp: int,
                        elem_bytes: int) -> CpBytes:
    """All-to-all (Ulysses, megalite/context/ulysses.py): q, k, v to head-sharded and the output back; the
    backward sends their gradients the reverse ways, in the same dtype. `heads`/`kv_heads` per tp rank."""
    per_head = batch * (seq_len // cp) * head_dim * elem_bytes
    moved = (cp - 1) * per_head * (2 * heads + 2 * kv_heads) // cp
    return CpBytes(moved, moved)


def hybrid_attention_bytes(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp: int, a2a: int,
                           elem_bytes: int) -> CpBytes:
    """Hybrid (megalite/context/hybrid.py): the all-to-all of S/cp tokens over a2a ranks, then the ring of the
    group's S/R tokens (R = cp / a2a) with hk/a2a kv heads."""
    ring = cp // a2a
    inner = a2a_attention_bytes(batch, seq_len // ring, heads, kv_heads, head_dim, a2a, elem_bytes)  # S/cp each
    outer = ring_attention_bytes(batch, seq_len, kv_heads // a2a, head_dim, ring, elem_bytes)
    return CpBytes(inner.forward + outer.forward, inner.backward + outer.backward)


def cp_attention_bytes(options: ContextOptions, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                       cp: int, elem_bytes: int) -> CpBytes:
    """The closed form of `options.mode` (ring | allgather | a2a | hybrid, with its a2a degree): heads and kv heads
    are per tp rank."""
    mode, a2a = options.mode, options.a2a_degree
    if mode == "hybrid":
        return hybrid_attention_bytes(batch, seq_len, heads, kv_heads, head_dim, cp, a2a, elem_bytes)
    if mode == "a2a":
        return a2a_attention_bytes(batch, seq_len, heads, kv_heads, head_dim, cp, elem_bytes)
    form = {"ring": ring_attention_bytes, "allgather": allgather_attention_bytes}[mode]
    return form(batch, seq_len, kv_heads, head_dim, cp, elem_bytes)
