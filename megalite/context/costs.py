"""Closed forms of what context parallelism costs: the bytes each cp mode moves per rank per attention call,
the ring's compute per step, the document ids' gather. The one home of these formulas: torch-free, so the cost
model (megalite/perfmodel/context.py) imports them rather than restating them.

In the counter's convention (megalite/parallel/counter.py: what one rank sends). `kv` is the number of
elements of this rank's K and V together, 2 b (S/cp) hk d (hq, hk: query and kv heads per tp rank); `e`
is their element size (K/V travel in the compute dtype); gradient partials travel in fp32 (4 bytes) in the
ring and all-gather forms so that their sums over the cp ranks do not lose bits in bf16.

    ring        forward (cp-1) kv e     backward (cp-1) kv (e + 4)   (ring.py: the K/V go once around the
                                                                        ring, the fp32 dK/dV travel back)
    all-gather  forward (cp-1) kv e     backward (cp-1) kv 4          (allgather.py: the K/V gathered once,
                                                                        the fp32 dK/dV reduce-scattered)
    a2a         forward (cp-1)/cp t (2 hq + 2 hk) e = backward, t = b (S/cp) d  (a2a.py: q, k, v out; the
                                                                        output back; gradients the reverse ways)
    hybrid      the a2a's over a2a ranks + the ring's over R = cp/a2a ranks of the group's S/R tokens with
                hk/a2a heads (hybrid.py)

Full recompute re-runs a block's forward, its cp exchange included; selective recompute does not (the
attention's backward keeps q, k, v, the output and the log-sum-exp). Under document masking each model chunk's
forward also all-gathers the int64 token ids over cp (megalite/model/gpt.py): (cp-1) b (S/cp) 8 bytes.

The ring's compute per step: with the zigzag split every step after the first computes a c x 2c block of
scores (c = S/(2cp)), half of a full (S/cp)^2 block: 2 b (S/cp)^2 hq d FLOPs forward (QK^T and PV, 2 FLOPs per
multiply-add), twice that backward; what each step's transfer can hide behind.

tests/test_context_parallel.py and tests/test_cp_modes.py hold the counter equal to these.
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
    """All-to-all (Ulysses, megalite/context/a2a.py): q, k, v to head-sharded and the output back; the
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


def document_ids_bytes(batch: int, seq_len: int, cp: int) -> int:
    """The int64 token ids each model chunk's forward all-gathers over cp under document masking."""
    return (cp - 1) * batch * (seq_len // cp) * 8


def ring_step_flops(batch: int, seq_len: int, heads: int, head_dim: int, cp: int) -> float:
    """Forward FLOPs of one zigzag ring step after the first (module doc); `heads` per tp rank."""
    local = seq_len // cp
    return 2.0 * batch * local * local * heads * head_dim
