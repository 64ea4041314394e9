"""Muon on the gradient sync's shards (a `ShardOptimizer`): Muon for the hidden matrices, AdamW for the rest.

`ShardMuon` holds a `ShardAdamW` over the same shards, restricted to the segments that are not Muon
matrices (`muon_plan.takes_muon`), and shares its per-shard state: the fp32 master weights of every element,
and the "exp_avg" buffer, which is AdamW's first moment on AdamW's elements and Muon's momentum on Muon's.
So checkpoints save, load and reshard Muon exactly like AdamW (`zero_state`: the same kinds, per element);
"exp_avg_sq" stays zero on Muon's elements (4 bytes per element a Muon-only layout would not hold).

A step (`muon_math` for the formulas; `muon_plan` for who owns what):
  1. each rank updates the momentum of its own elements and forms the Nesterov direction U there;
  2. ZeRO >= 1: the pieces of U of each matrix go to the matrix's dp owner (`OwnerExchange.gather` over the
     bucket's group); then over tp to the matrix's tp owner, who now has the whole logical matrix;
  3. the owner runs Newton-Schulz per logical matrix and scales by lr_scale; the results go back the same
     way (`scatter` over tp, then over dp), so each rank holds its own elements' update;
  4. each rank applies the update and weight decay to its masters; AdamW then steps the other elements
     and casts every master into the shard's params, which the gradient sync publishes as for AdamW
     (the usual ZeRO-1/2 parameter all-gather, ZeRO-3's gather per unit): no other extra traffic.
Bytes per step, all under the counter key "muon": see `megalite.perfmodel.muon`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from megalite.dp.shards import Shard
from megalite.errors import ConfigError
from megalite.optim.config import MuonConfig
from megalite.optim.muon_math import lr_scale, newton_schulz
from megalite.optim.muon_plan import MuonMatrix, MuonPlan
from megalite.optim.shard_adamw import FUSED_ADAMW_DEVICES, ShardAdamW
from megalite.parallel.state import ParallelState


def adam_shards(shards: Sequence[Shard], plan: MuonPlan) -> list[Shard]:
    """The same shards with the Muon matrices' segments left out (what AdamW updates): a segment whose
    elements are all Muon's (one matrix, or a stack of experts' matrices)."""
    pieces: dict[int, list[slice]] = {}
    for m, s in zip(plan.matrices, plan.own):
        if s.stop > s.start:
            pieces.setdefault(m.bucket, []).append(s)

    def muon(i: int, lo: int, hi: int) -> bool:
        return hi > lo and sum(max(0, min(s.stop, hi) - max(s.start, lo)) for s in pieces.get(i, [])) == hi - lo

    return [replace(sh, segments=tuple(g for g in sh.segments if not muon(i, g.lo, g.hi)))
            for i, sh in enumerate(shards)]


class ShardMuon:
    """Muon (hidden matrices) + AdamW (the rest) on `shards`, distributed by `plan`."""

    def __init__(self, shards: Sequence[Shard], initial: Sequence[torch.Tensor], plan: MuonPlan,
                 state: ParallelState, settings: MuonConfig, weight_decay: float, betas: tuple[float, float],
                 eps: float) -> None:
        if shards and shards[0].params.device.type not in FUSED_ADAMW_DEVICES:
            # The unfused AdamW loop walks whole shards, Muon's elements included.
            raise ConfigError(f"optimizer.name=muon runs on {' or '.join(FUSED_ADAMW_DEVICES)} only")
        self.shards, self.plan, self.state, self.settings = list(shards), plan, state, settings
        self.weight_decay = weight_decay
        self.adam = ShardAdamW(adam_shards(shards, plan), initial, weight_decay, betas, eps)
        self.state_kinds = self.adam.state_kinds

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adam.step_count = value

    @torch.no_grad()
    def step(self, lr: float) -> None:
        updates = self._muon_updates(lr)
        for m, own, upd in zip(self.plan.matrices, self.plan.own, updates):
            master = self.adam.states[m.bucket].master[own]
            if self.weight_decay:
                master.mul_(1 - lr * self.weight_decay)
            master.sub_(upd)
        self.adam.step(lr)  # AdamW on the rest; casts every master (Muon's too) into the params

    def _muon_updates(self, lr: float) -> list[torch.Tensor]:
        """Per matrix, this rank's elements of lr * lr_scale * NS5(U) (flat), after the momentum step."""
        mu, plan = self.settings.momentum, self.plan
        device = self.state.device
        dirs = []
        for m, own in zip(plan.matrices, plan.own):
            g, buf = self.shards[m.bucket].grad[own], self.adam.states[m.bucket].exp_avg[own]
            buf.mul_(mu).add_(g)
            dirs.append(g.add(buf, alpha=mu) if self.settings.nesterov else buf.clone())
        local: dict[int, torch.Tensor] = {}  # matrix index -> this TP rank's whole piece of U
        for items, ex in plan.dp.values():
            for k, pieces in ex.gather([dirs[i] for i in items], device).items():
                local[items[k]] = torch.cat(pieces)
        whole = plan.tp.gather([local[i] for i in plan.tp_items], device)
        results = {k: self._orthogonalise(plan.matrices[plan.tp_items[k]], pieces, lr)
                   for k, pieces in whole.items()}
        back = plan.tp.scatter(results, device)
        mine = {i: back[k] for k, i in enumerate(plan.tp_items)}
        for i in plan.local_items:  # whole on every TP rank (an expert): orthogonalised here, alike on each
            mine[i] = self._orthogonalise(plan.matrices[i], [local[i]], lr)[0]
        out: list[torch.Tensor] = [torch.empty(0)] * len(plan.matrices)
        for items, ex in plan.dp.values():
            got = ex.scatter({k: list(mine[items[k]].split(ex.sizes[k])) for k in ex.owned}, device)
            for k, t in enumerate(got):
                out[items[k]] = t
        return out

    def _orthogonalise(self, m: MuonMatrix, pieces: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        """The TP ranks' pieces of `m`'s U -> each TP rank's piece of the scaled update (flat)."""
        tp = len(pieces)
        local = [p.view(m.shape) for p in pieces]
        if m.layout.kind == "row":  # input features split: the whole matrix is the pieces side by side
            rows, cols = m.logical(tp)[0]
            o = newton_schulz(torch.cat(local, dim=1), self.settings.ns_steps)
            o.mul_(lr * lr_scale(rows, cols, self.settings.rms))
            return [c.reshape(-1) for c in o.chunk(tp, dim=1)]
        outs: list[list[torch.Tensor]] = [[] for _ in range(tp)]
        start = 0
        for rows, cols in m.logical(tp):  # column: each part split over tp separately ([q_i; k_i; v_i])
            n = rows // tp
            o = newton_schulz(torch.cat([t[start:start + n] for t in local]), self.settings.ns_steps)
            o.mul_(lr * lr_scale(rows, cols, self.settings.rms))
            for r, c in enumerate(o.chunk(tp)):
                outs[r].append(c)
            start += n
        return [torch.cat(o).reshape(-1) for o in outs]

    def state_shards(self) -> list[dict[str, torch.Tensor]]:
        return self.adam.state_shards()

    def load_state_shards(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        self.adam.load_state_shards(states, step)

    def memory_bytes(self) -> dict[str, int]:
        return self.adam.memory_bytes()
