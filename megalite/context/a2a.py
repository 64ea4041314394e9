"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) over a zigzag-split sequence.

Every cp rank holds S/cp tokens of each sequence (its zigzag chunks r and 2cp-1-r, `zigzag.py`) and all of
its hq query and hk kv heads. One all-to-all over the 'cp' group turns that into the whole sequence for
hq/cp query and hk/cp kv heads: rank j receives head group j of every rank's tokens. Query head group j
reads kv head group j (query head h reads kv head h // (hq/hk), so contiguous groups line up whenever hk
is divisible by cp: the validation's rule). Attention is then ordinary causal attention over S tokens,
computed by the model's own kernel (SDPA, or the Triton flash kernel), and a second all-to-all sends each
rank's rows back to their sequence owners, with all heads.

The zigzag order: the gathered sequence is rank 0's tokens, then rank 1's, ..., i.e. chunks 0, 2cp-1, 1,
2cp-2, ...; a causal mask is only right in position order, so the gathered q/k/v are permuted into position
order before attention and the output permuted back (an index copy each way, no communication).

Bytes per rank per call (counter convention: an all-to-all sends (cp-1)/cp of its input), with
t = b (S/cp) d e the elements of one head of this rank's tokens times their element size:

    forward   (cp-1)/cp t (hq + 2 hk)   q, k, v in one all-to-all
            + (cp-1)/cp t hq            the output back
    backward  the same: the gradients take the reverse paths, in the same dtype

independent of cp to first order (the ring's grow with cp - 1): with many heads and a fast all-to-all
(inside a node) this is the cheaper form; its degree is capped by the head count.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megalite.context.group import GROUP
from megalite.context.zigzag import zigzag_positions
from megalite.errors import ConfigError
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor
LocalAttention = Callable[[Tensor, Tensor, Tensor], Tensor]  # causal [b, S, h, d] attention (ops.attention)


def check_a2a_heads(heads: int, kv_heads: int, cp: int, mode: str = "a2a") -> None:
    """A ConfigError unless this rank's query and kv heads split into cp (the a2a degree) equal groups."""
    if heads % cp or kv_heads % cp:
        what = "cp" if mode == "a2a" else "the a2a degree parallel.cp_a2a"
        raise ConfigError(f"cp_mode={mode}: {heads} query and {kv_heads} kv heads per tensor-parallel rank are not "
                          f"both divisible by {what} = {cp} (each a2a rank attends for 1/{cp} of the heads)")


# The cp ranks of this rank's all-to-all: None = the whole 'cp' group, else their cp ranks (consecutive, hybrid cp).
Members = Optional[tuple[int, ...]]


def a2a_members(state: ParallelState, degree: int) -> Members:
    """The cp ranks this rank all-to-alls with: the `degree` consecutive cp ranks around ours (None: all of them)."""
    if degree == state.size(GROUP):
        return None
    first = state.cp_rank // degree * degree
    return tuple(range(first, first + degree))


def _exchange(send: Tensor, state: ParallelState, members: Members) -> Tensor:
    """[n, ...] -> [n, ...]: chunk j to the j-th member, chunk r of the result from the r-th member. A subset of
    the cp ranks exchanges over the 'cp' communicator with empty messages to the others (one collective, no extra
    process group; every cp rank is in one subset and calls it at the same time)."""
    if members is None:
        return comm.all_to_all(send, state, GROUP)
    splits = [1 if r in members else 0 for r in range(state.size(GROUP))]
    rows = send.reshape(len(members), -1)
    return comm.all_to_all_single(rows, state, GROUP, splits, splits).view_as(send)


class _Exchange(torch.autograd.Function):
    """to_heads: [b, s, n, g, d] (this rank's s tokens, n head groups) -> [b, n*s, g, d] (every member's
    tokens in member order, this rank's head group); else the inverse. The backward is the other direction."""

    @staticmethod
    def forward(ctx, x: Tensor, state: ParallelState, members: Members,  # type: ignore[override]
                to_heads: bool) -> Tensor:
        ctx.state, ctx.members, ctx.to_heads = state, members, to_heads
        return _seq_to_heads(x, state, members) if to_heads else _heads_to_seq(x, state, members)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        back = _heads_to_seq(g, ctx.state, ctx.members) if ctx.to_heads else _seq_to_heads(g, ctx.state, ctx.members)
        return back, None, None, None


def _seq_to_heads(x: Tensor, state: ParallelState, members: Members) -> Tensor:
    b, s, n, g, d = x.shape
    got = _exchange(x.permute(2, 0, 1, 3, 4).contiguous(), state, members)  # [n (source), b, s, g, d]
    return got.transpose(0, 1).reshape(b, n * s, g, d)


def _heads_to_seq(x: Tensor, state: ParallelState, members: Members) -> Tensor:
    b, total, g, d = x.shape
    n = state.size(GROUP) if members is None else len(members)
    got = _exchange(x.view(b, n, total // n, g, d).transpose(0, 1).contiguous(), state, members)
    return got.permute(1, 2, 0, 3, 4)  # [b, s, n (head group), g, d]


def head_group(state: ParallelState, degree: int) -> int:
    """Which of the `degree` head groups this rank attends for after the exchange: its index among its members
    (query heads [g hq/degree, (g+1) hq/degree) and their sinks: the sinks are sharded with their heads)."""
    return state.cp_rank % degree


def gathered_positions(seq_len: int, cp: int, device: torch.device | None = None,
                       members: Members = None) -> Tensor:
    """The positions of the gathered sequence's tokens (the members' zigzag splits, in member order)."""
    ranks = range(cp) if members is None else members
    return torch.cat([zigzag_positions(seq_len, cp, r, device) for r in ranks])


def a2a_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, attend: LocalAttention,
                  degree: int | None = None) -> Tensor:
    """Causal GQA attention of this rank's zigzag-split tokens, with the contract of `ring_attention`:
    q [b, S/cp, hq, d], k/v [b, S/cp, hk, d] -> [b, S/cp, hq, d]. `attend` is causal attention over the
    gathered tokens in position order (the model's kernel; for a `degree` below cp, hybrid cp, the ring over
    the other groups, which receives its ring's zigzag split: see hybrid.py). Collective over the 'cp' group
    (bytes under 'cp'); `degree` (default cp) ranks exchange heads with each other."""
    cp = state.size(GROUP)
    degree = cp if degree is None else degree
    b, s, hq, d = q.shape
    hk = k.shape[2]
    check_a2a_heads(hq, hk, degree, "a2a" if degree == cp else "hybrid")
    if k.shape[1] != s or v.shape != k.shape:
        raise ValueError(f"a2a_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if degree == 1:
        return attend(q, k, v)
    members = a2a_members(state, degree)
    gq, gk = hq // degree, hk // degree
    # One all-to-all for q, k and v: per destination, its query heads then its kv heads.
    packed = torch.cat([q.view(b, s, degree, gq, d), k.view(b, s, degree, gk, d), v.view(b, s, degree, gk, d)],
                       dim=3)
    full = _Exchange.apply(packed, state, members, True)           # [b, degree*s, gq + 2 gk, d], member order
    order = torch.argsort(gathered_positions(s * cp, cp, q.device, members))  # gathered index of each position
    full = full[:, order]                                  # position order: the causal mask holds
    out = attend(full[:, :, :gq], full[:, :, gq:gq + gk], full[:, :, gq + gk:])  # [b, degree*s, gq, d]
    back = _Exchange.apply(out[:, torch.argsort(order)].contiguous(), state, members, False)  # [b, s, n, gq, d]
    return back.reshape(b, s, hq, d)
