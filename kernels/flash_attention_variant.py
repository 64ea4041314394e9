"""What the flash kernels add to plain FlashAttention-2: document segment ids and the attention variants.

Why a module of its own: `flash_attention.py` is the FlashAttention-2 algorithm (online softmax forward, the
recomputing backward, grouped-query heads); the masks and score changes below are orthogonal to it, enter its
kernels only under constexpr flags, and are shared by the whole-sequence kernel and the context-parallel block
kernels (`flash_attention_block.py`). Here are their in-kernel helpers (`@jit`, called from the kernels of
`flash_attention.py`; `_triton._materialize` builds them with their own module), their host-side arguments
(`Segments`, `Variant`), their checks and the sinks' gradient.

Document masking (varlen-style segment ids, megalite/context/documents.py): with `segments` [B, S] (each
token's document index) query i sees key j only within its own document. A tile of queries x keys whose
document ranges [min, max] do not overlap holds no visible pair and is skipped whole (no loads of its K/V,
dO or Q, no dots): packed short documents cost about sum(len_doc^2) instead of S^2 / 2 (block skipping, as
FlexAttention's block mask or FlashAttention's varlen). Correct for any ids; skips most when they are
non-decreasing along S, as documents' are.

Attention variants (megalite/attention/variant.py, docs/attention.md), the `Variant` argument:
- sliding window W (key j visible to query i iff 0 <= i - j < W): with the causal mask the loops start at the
  key tile holding max(0, first row - W + 1) (forward, dQ) and stop at the query tile holding the last key +
  W - 1 (dK/dV), so a windowed layer visits O(S W) tiles, not O(S^2) (megalite/attention/costs.py counts
  them); with positions (context parallelism's blocks) a tile is skipped when its position ranges hold no
  pair inside the window;
- soft-cap c: scores c tanh(s / c) (tanh through exp, as gelu.py), and dS times 1 - tanh^2 in both backward
  kernels;
- sinks (one logit per query head): after the last tile the forward adds exp(sink) to each row's
  denominator, i.e. rescales O by exp(L - L') and stores L' = log(exp(L) + exp(sink)). The backward then runs
  unchanged on L' and D' = rowsum(dO O'): P = exp(S - L') already has the sink in its denominator and the
  sink's own dS, p_sink (0 - D'), has no key to reach; d sink = -sum_rows exp(sink - L') D' (`sink_grad`).
  No dLSE input is needed: the rescale is inside the softmax, not applied to its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ._triton import jit, tl  # lazy stand-ins: _triton.py

# Scores are kept in base 2 inside the kernels (scale * log2(e) folded into QK^T; exp2 throughout).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453  # 1 / LOG2E


@jit
def _segment_range(SEG, offs, N):
    """(ids, min, max) of the document ids (or positions: any ids >= 0) of a tile's rows `offs` (rows past N: -1,
    outside the range)."""
    inside = offs < N
    seg = tl.load(SEG + offs, mask=inside, other=-1)
    return seg, tl.min(tl.where(inside, seg, 2147483647), axis=0), tl.max(seg, axis=0)


@jit
def _logits(qk, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """(base-2 scores, tanh) from the base-2 scaled dots: the soft-cap c tanh(s / c) (cap_in = 1 / (c log2 e),
    cap_out = c log2 e) when SOFTCAP, else the dots as they are (tanh then unused: 0)."""
    if SOFTCAP:  # tanh through exp (runs alike in the interpreter and on every GPU backend, as kernels/gelu.py)
        z = tl.minimum(tl.maximum(qk * cap_in, -15.0), 15.0)  # tanh(15) == 1 in fp32; no exp overflow
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        return t * cap_out, t
    return qk, 0.0


@jit
def _window_keep(valid, rows, cols, WINDOW, HAS_WINDOW: tl.constexpr):
    """`valid`, and row position - column position < WINDOW when there is a window (variant.py's convention)."""
    if HAS_WINDOW:
        valid = valid & (rows[:, None] - cols[None, :] < WINDOW)
    return valid


# (query document ids [B, SQ], key document ids [B, SK]), integers >= 0: key j is visible to query i only when
# their ids are equal. The whole-sequence kernel passes the same [B, S] ids twice; a context-parallel block passes
# its query rows' and its keys' (megalite/attention/blocks.py PositionMask.docs).
Segments = Optional[tuple[torch.Tensor, torch.Tensor]]


def _segment_args(segments: Segments, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The QSEG, KSEG kernel arguments: the document ids as contiguous int32, or a placeholder never read."""
    if segments is None:
        return placeholder, placeholder
    query, key = segments
    if query is key:  # the same tokens: one copy
        seg = query.to(torch.int32).contiguous()
        return seg, seg
    return query.to(torch.int32).contiguous(), key.to(torch.int32).contiguous()


@dataclass(frozen=True)
class Variant:
    """The attention variant as the kernels take it (megalite/attention/variant.py): `window` W (key j visible
    to query i iff 0 <= i - j < W, in positions: causal or `positions` masks only), `softcap` c (scores
    c tanh(s / c)), `sinks` [Hq] natural-log sink logits (forward: folded into O and the LSE; the backward
    takes that LSE as it is), `tiles` an int32 [3] counter of the (query tile, key tile) pairs visited by the
    forward, the dK/dV and the dQ kernels (tests and benchmarks; None: not counted)."""

    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    tiles: Optional[torch.Tensor] = None

    def args(self, placeholder: torch.Tensor) -> tuple[Any, ...]:
        """TILES, cap_in, cap_out, WINDOW kernel arguments."""
        cap = self.softcap if self.softcap is not None else 1.0
        tiles = self.tiles if self.tiles is not None else placeholder
        return tiles, 1.0 / (cap * LOG2E), cap * LOG2E, self.window if self.window is not None else 0

    def flags(self) -> dict[str, bool]:
        return dict(HAS_WINDOW=self.window is not None, SOFTCAP=self.softcap is not None, COUNT=self.tiles is not None)


PLAIN = Variant()


def _same(segments: Optional[torch.Tensor]) -> Segments:
    """The whole-sequence kernel's [B, S] ids as both the queries' and the keys'."""
    return None if segments is None else (segments, segments)


def check_variant(variant: Variant, masked: bool, heads: int, name: str) -> None:
    """A window needs a causal or positions mask (it counts back from the query); a soft-cap is positive; the
    sinks are one per query head."""
    if variant.window is not None and (variant.window < 1 or not masked):
        raise ValueError(f"{name}: window {variant.window} needs to be >= 1, with a causal or positions mask")
    if variant.softcap is not None and not variant.softcap > 0:
        raise ValueError(f"{name}: softcap {variant.softcap} must be > 0")
    if variant.sinks is not None and tuple(variant.sinks.shape) != (heads,):
        raise ValueError(f"{name}: sinks {tuple(variant.sinks.shape)}, expected one per query head ({heads},)")
    if variant.tiles is not None and (variant.tiles.dtype != torch.int32 or variant.tiles.numel() < 3):
        raise ValueError(f"{name}: tiles must be an int32 counter of 3 elements")


def sink_grad(lse2: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sink [Hq] = -sum over batch and rows of exp(sink - L') D', from the base-2 L' [B*Hq, S] the forward
    wrote (sinks included) and D' = rowsum(dO O') [B*Hq, S]: the sink is one more logit of each row's softmax
    whose value is zero, so its dS is p_sink (0 - D')."""
    hq = sinks.shape[0]
    sink2 = sinks.detach().float().view(1, hq, 1) * LOG2E
    p = torch.exp2(sink2 - lse2.view(-1, hq, lse2.shape[-1]))
    return -(p * delta.view_as(p)).sum(dim=(0, 2)).to(sinks.dtype)
