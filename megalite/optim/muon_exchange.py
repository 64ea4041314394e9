"""Moving the pieces of whole matrices to the rank that orthogonalises each, and the results back.

Muon's update needs every matrix whole, but the ranks of a group each hold a piece of it: ZeRO-1/2/3 shards
a bucket's flat buffer over its dp group (a rank's range can start or end inside a matrix), tensor
parallelism splits it over tp. `OwnerExchange` is one such group: each item (a matrix) has one *owner*
rank, every rank knows the size of every rank's piece of every item (static geometry, the same on all
ranks), and

    gather(my pieces)     -> for each item I own, every rank's piece, in rank order   (one all-to-all)
    scatter(my results)   -> my piece of every item's result, from its owner           (one all-to-all)

Both are `comm.all_to_all_single` with variable splits, counted under "muon": a rank's count is what it
sends to the others (a piece that stays on its owner does not travel). Over the whole group an item of S
elements spread over n ranks moves 2 (S - owner's piece) elements per step, against the (n-1) S of an
all-gather to every rank: the owner approach moves fewer bytes for n > 2 and the same for n = 2, and
does each item's Newton-Schulz once instead of on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megalite.parallel import comm
from megalite.parallel.state import GroupKind, ParallelState


class OwnerExchange:
    """Items `owners[i]` (an index in `group`) with `sizes[i][r]` elements on the group's rank r.
    `alone`: this rank by itself (it holds every item whole and owns it; nothing moves)."""

    def __init__(self, state: ParallelState, group: GroupKind, owners: Sequence[int],
                 sizes: Sequence[Sequence[int]], alone: bool = False) -> None:
        self.state, self.group = state, group
        self.n, self.me = (1, 0) if alone else (state.size(group), state.rank_in(group))
        self.owners, self.sizes = list(owners), [list(s) for s in sizes]
        assert all(len(s) == self.n for s in self.sizes), "one size per rank of the group"
        self.owned = [i for i, o in enumerate(self.owners) if o == self.me]

    def _of(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owners) if o == rank]

    def _exchange(self, send: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                  device: torch.device) -> torch.Tensor:
        flat = torch.cat(send) if send else torch.empty(0, device=device)
        if self.n == 1 or (sum(send_splits) == 0 and sum(recv_splits) == 0):
            return flat
        return comm.all_to_all_single(flat, self.state, self.group, send_splits, recv_splits, count_as="muon")

    def gather(self, mine: Sequence[torch.Tensor], device: torch.device) -> dict[int, list[torch.Tensor]]:
        """`mine[i]`: this rank's piece of item i (flat, `sizes[i][me]` elements). Returns, for every item
        this rank owns, the pieces of ranks 0..n-1 (flat)."""
        send, send_splits = [], []
        for j in range(self.n):
            items = self._of(j)
            send += [mine[i].reshape(-1) for i in items]
            send_splits.append(sum(self.sizes[i][self.me] for i in items))
        recv_splits = [sum(self.sizes[i][r] for i in self.owned) for r in range(self.n)]
        got = self._exchange(send, send_splits, recv_splits, device)
        out: dict[int, list[torch.Tensor]] = {i: [] for i in self.owned}
        off = 0
        for r in range(self.n):
            for i in self.owned:
                out[i].append(got[off:off + self.sizes[i][r]])
                off += self.sizes[i][r]
        return out

    def scatter(self, results: dict[int, list[torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
        """`results[i][r]`: rank r's piece of owned item i's result (flat). Returns this rank's piece of
        every item's result, in item order."""
        send = [results[i][r].reshape(-1) for r in range(self.n) for i in self.owned]
        send_splits = [sum(self.sizes[i][r] for i in self.owned) for r in range(self.n)]
        recv_splits = [sum(self.sizes[i][self.me] for i in self._of(j)) for j in range(self.n)]
        got = self._exchange(send, send_splits, recv_splits, device)
        out: list[torch.Tensor | None] = [None] * len(self.owners)
        off = 0
        for j in range(self.n):
            for i in self._of(j):
                out[i] = got[off:off + self.sizes[i][self.me]]
                off += self.sizes[i][self.me]
        return [t if t is not None else torch.empty(0, device=device) for t in out]


def greedy_owners(loads: Sequence[int], n: int) -> list[int]:
    """Each item to the rank with the least load so far, largest items first (ties: lowest rank, then
    item order): the classic LPT balance, within 4/3 of the best makespan."""
    total = [0] * n
    owners = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        r = min(range(n), key=lambda r: (total[r], r))
        owners[i] = r
        total[r] += loads[i]
    return owners
