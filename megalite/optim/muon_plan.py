"""Which parameters Muon updates, where their pieces lie, and which rank orthogonalises each.

Muon takes the 2-D weights of the tensor-parallel linears (`ParamSpec.layout` column or row) inside the
transformer blocks (the units the model is made of, `MadeOfUnits.units()`): attention qkv and out, the MLP's up/gate
and down. Everything else stays on AdamW, as in Jordan et al. 2024 and Liu et al. 2025: the embedding
and the output layer (a column-parallel linear too, but outside the blocks), norms, biases, learned
positions, and the MoE router (a replicated matrix). The MoE experts are stacks of whole matrices
([E/ep, rows, cols], replicated over tp: `ParamSpec.stack`): each expert's matrix is one Muon matrix (its up
per logical part, gate and up), owned over the experts' own gradient group like any other under ZeRO and
orthogonalised by that owner on every TP rank of its tp group alike (each holds it whole: no tp exchange).

A fused column linear is orthogonalised per *logical* matrix (`TPLayout.parts`: q, k and v of the fused
qkv; gate and up of SwiGLU), as Megatron-core's Muon splits qkv: the fusion is an implementation detail
(three linears computed in one GEMM), each part has its own shape and scale, and orthogonalising the
stack would couple q's singular values with v's. Each part gets its own `lr_scale`.

Ownership, two levels (both by `muon_exchange.greedy_owners`, balanced by elements):
  dp  under ZeRO >= 1 a bucket is sharded over its group; each matrix (this TP rank's piece of it) gets an
      owner among the group's ranks, who gathers the other ranks' pieces. Every TP rank of a tp group
      has the same buckets and the same group index, so they agree on what they own.
  tp  the dp owners (all ranks of one tp group) split their matrices over tp: each matrix's owner gathers
      the other TP ranks' pieces, orthogonalises the whole matrix and sends each its piece back.
At ZeRO 0 each dp rank holds whole buckets and orthogonalises redundantly (no dp exchange).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch.nn as nn

from megalite.dp.buckets import Bucket
from megalite.optim.muon_exchange import OwnerExchange, greedy_owners
from megalite.parallel.param_spec import ParamSpec, TPLayout
from megalite.parallel.state import GroupKind, ParallelState
from megalite.parallel.units import MadeOfUnits


def takes_muon(p: nn.Parameter, spec: ParamSpec) -> bool:
    """`p` (a parameter of a block) is a hidden matrix: a 2-D weight of a tensor-parallel linear."""
    return p.dim() == 2 and spec.matrix and spec.layout.kind in ("column", "row") and p.requires_grad


def block_params(chunks: Sequence[nn.Module]) -> set[int]:
    """ids of the parameters inside the chunks' transformer blocks (the units they are made of), where Muon's
    hidden matrices are."""
    return {id(p) for c in chunks if isinstance(c, MadeOfUnits) for unit in c.units() for p in unit.parameters()}


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon parameter: `shape` (this TP rank's) at `offset` in bucket `bucket`'s flat buffer."""

    name: str
    bucket: int
    offset: int
    shape: tuple[int, int]
    layout: TPLayout
    parts: tuple[int, ...] = ()  # one matrix of a stack (an expert): whole on every TP rank, rows in these parts

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def logical(self, tp: int) -> list[tuple[int, int]]:
        """The whole logical matrices (rows, cols) Newton-Schulz runs on, in the local rows' order."""
        rows, cols = self.shape
        if self.parts:
            return [(part, cols) for part in self.parts]
        if self.layout.kind == "column":
            return [(part, cols) for part in self.layout.parts]
        return [(rows, cols * tp)]


@dataclass
class MuonPlan:
    """The Muon matrices of this rank's buckets, and the exchanges that make them whole."""

    matrices: list[MuonMatrix]
    own: list[slice]                    # per matrix: this rank's piece, in its bucket's shard coordinates
    dp: dict[GroupKind, tuple[list[int], OwnerExchange]]  # per bucket group: its matrices, their exchange
    tp: OwnerExchange                   # over the matrices this rank's dp index owns (`tp_items`)
    tp_items: list[int]
    local_items: list[int] = field(default_factory=list)  # owned stacked matrices: whole here, no tp exchange


def _piece(off: int, numel: int, lo: int, hi: int) -> tuple[int, int]:
    """The overlap of [off, off + numel) with a shard [lo, hi), as (start, length); length 0 if none."""
    a, b = max(off, lo), min(off + numel, hi)
    return (a, b - a) if a < b else (lo, 0)


def build_plan(buckets: Sequence[Bucket], specs: Mapping[nn.Parameter, ParamSpec], names: Mapping[int, str],
               blocks: set[int], state: ParallelState, sharded: bool) -> MuonPlan:
    """The plan for the gradient sync's `buckets` (`sharded`: ZeRO >= 1, each rank owns 1/N of each);
    `blocks`: the ids of the block parameters (`block_params`). Each matrix of a stacked parameter
    (`ParamSpec.stack`) is one Muon matrix."""
    matrices: list[MuonMatrix] = []
    for bi, b in enumerate(buckets):
        for p, off in zip(b.params, b.offsets):
            if id(p) not in blocks or not p.requires_grad:
                continue
            stack = specs[p].stack
            if stack is not None and p.dim() == 3:
                n, r, c = (int(x) for x in p.shape)
                matrices += [MuonMatrix(f"{names[id(p)]}[{e}]", bi, off + e * r * c, (r, c), specs[p].layout,
                                        stack.rows) for e in range(n)]
            elif takes_muon(p, specs[p]):
                matrices.append(MuonMatrix(names[id(p)], bi, off, (int(p.shape[0]), int(p.shape[1])), specs[p].layout))
    own, dp_sizes = [], []
    for m in matrices:
        b = buckets[m.bucket]
        n = state.size(b.group) if sharded else 1
        size = b.shard_numel if sharded else b.padded
        pieces = [_piece(m.offset, m.numel, r * size, (r + 1) * size) for r in range(n)]
        start, length = pieces[state.rank_in(b.group) if sharded else 0]
        own.append(slice(start - b.lo, start - b.lo + length))
        dp_sizes.append([length for _, length in pieces])
    dp: dict[GroupKind, tuple[list[int], OwnerExchange]] = {}
    mine: list[int] = []
    for group in dict.fromkeys(buckets[m.bucket].group for m in matrices):
        items = [i for i, m in enumerate(matrices) if buckets[m.bucket].group == group]
        n = state.size(group) if sharded else 1
        owners = greedy_owners([matrices[i].numel for i in items], n)
        ex = OwnerExchange(state, group, owners, [dp_sizes[i] for i in items], alone=not sharded)
        dp[group] = (items, ex)
        mine += [items[k] for k in ex.owned]
    mine.sort()
    split, whole = [i for i in mine if not matrices[i].parts], [i for i in mine if matrices[i].parts]
    tp_owners = greedy_owners([matrices[i].numel for i in split], state.tp)
    tp = OwnerExchange(state, "tp", tp_owners, [[matrices[i].numel] * state.tp for i in split])
    return MuonPlan(matrices, own, dp, tp, split, whole)

