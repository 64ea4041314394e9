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

from typing import Callable

import torch

from megalite.context.group import GROUP
from megalite.context.zigzag import zigzag_positions
from megalite.errors import ConfigError
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor
LocalAttention = Callable[[Tensor, Tensor, Tensor], Tensor]  # causal [b, S, h, d] attention (ops.attention)


def check_a2a_heads(heads: int, kv_heads: int, cp: int) -> None:
    """A ConfigError unless this rank's query and kv heads split into cp equal groups."""
    if heads % cp or kv_heads % cp:
        raise ConfigError(f"cp_mode=a2a: {heads} query and {kv_heads} kv heads per tensor-parallel rank are not "
                          f"both divisible by cp = {cp} (each cp rank attends for 1/cp of the heads)")


def _exchange(send: Tensor, state: ParallelState) -> Tensor:
    """[cp, ...] -> [cp, ...]: chunk j to cp rank j, chunk r of the result from cp rank r."""
    return comm.all_to_all(send, state, GROUP)


class _Exchange(torch.autograd.Function):
    """to_heads: [b, s, cp, g, d] (this rank's s tokens, cp head groups) -> [b, cp*s, g, d] (every rank's
    tokens in rank order, this rank's head group); else the inverse. The backward is the other direction."""

    @staticmethod
    def forward(ctx, x: Tensor, state: ParallelState, to_heads: bool) -> Tensor:  # type: ignore[override]
        ctx.state, ctx.to_heads = state, to_heads
        return _seq_to_heads(x, state) if to_heads else _heads_to_seq(x, state)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return (_heads_to_seq(g, ctx.state) if ctx.to_heads else _seq_to_heads(g, ctx.state)), None, None


def _seq_to_heads(x: Tensor, state: ParallelState) -> Tensor:
    b, s, cp, g, d = x.shape
    got = _exchange(x.permute(2, 0, 1, 3, 4), state)          # [cp (source rank), b, s, g, d]
    return got.transpose(0, 1).reshape(b, cp * s, g, d)


def _heads_to_seq(x: Tensor, state: ParallelState) -> Tensor:
    b, total, g, d = x.shape
    cp = state.size(GROUP)
    got = _exchange(x.view(b, cp, total // cp, g, d).transpose(0, 1), state)  # [cp (head group), b, s, g, d]
    return got.permute(1, 2, 0, 3, 4)


def gathered_positions(seq_len: int, cp: int, device: torch.device | None = None) -> Tensor:
    """The positions of the gathered sequence's tokens (every rank's zigzag split, in rank order)."""
    return torch.cat([zigzag_positions(seq_len, cp, r, device) for r in range(cp)])


def a2a_attention(q: Tensor, k: Tensor, v: Tensor, state: ParallelState, attend: LocalAttention) -> Tensor:
    """Causal GQA attention of this rank's zigzag-split tokens, with the contract of `ring_attention`:
    q [b, S/cp, hq, d], k/v [b, S/cp, hk, d] -> [b, S/cp, hq, d]. `attend` is causal attention over a
    whole sequence in position order (the model's kernel). Collective over the 'cp' group (bytes under 'cp')."""
    cp = state.size(GROUP)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    check_a2a_heads(hq, hk, cp)
    if k.shape[1] != s or v.shape != k.shape:
        raise ValueError(f"a2a_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if cp == 1:
        return attend(q, k, v)
    gq, gk = hq // cp, hk // cp
    # One all-to-all for q, k and v: per destination, its query heads then its kv heads.
    packed = torch.cat([q.view(b, s, cp, gq, d), k.view(b, s, cp, gk, d), v.view(b, s, cp, gk, d)], dim=3)
    full = _Exchange.apply(packed, state, True)                     # [b, S, gq + 2 gk, d], rank order
    pos = gathered_positions(s * cp, cp, q.device)
    order = torch.argsort(pos)                                 # gathered index of each position
    full = full[:, order]                                  # position order: the causal mask holds
    out = attend(full[:, :, :gq], full[:, :, gq:gq + gk], full[:, :, gq + gk:])  # [b, S, gq, d]
    back = _Exchange.apply(out[:, pos].contiguous(), state, False)  # rank order again -> [b, s, cp, gq, d]
    return back.reshape(b, s, hq, d)
