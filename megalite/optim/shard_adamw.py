"""AdamW on the flat shards the gradient sync hands over, with fp32 master weights (a `ShardOptimizer`).

Per shard it keeps an fp32 master copy of the parameters it updates (none in fp32: the parameters are
their own master, the master *is* the shard's `params`) and the two Adam moments, all of the shard's
length: at ZeRO >= 1 that is 1/N of each bucket, which is where ZeRO-1's memory saving comes from.
After each update the master is cast into the shard's `params`; publishing them to the other ranks is
the gradient sync's business.

torch's fused kernel (the one `torch.optim.AdamW(fused=True)` and Hugging Face's Trainer use, wrapped in
`megalite.torch_private`): one pass over memory for the whole update, two calls per shard (the
decayed pieces, the rest) instead of seven elementwise ops per tensor. It is elementwise and its result
does not depend on an element's position, so a sharded update equals the replicated one to the last bit
(tests/test_adamw_flat.py). It differs from the unfused `foreach=False` arithmetic by at most an ulp on
a few elements (fused multiply-adds). Padding elements belong to no segment and are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megalite import torch_private
from megalite.dp.shards import Segment, Shard

ADAMW_CHUNK = 1 << 16  # fallback loop: elements per chunk (4 fp32 tensors x 256 KiB stay in a 1-2 MiB L2)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel (torch >= 2.4)


@dataclass(eq=False)
class AdamWState:
    """One shard's state: fp32 master weights and moments, [numel] each."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class ShardAdamW:
    """AdamW (Loshchilov & Hutter 2019), decay on matrices only, over `shards`. `initial[i]`: shard i's
    fp32 values (its `params` themselves when they are fp32, which then serve as the master)."""

    state_kinds: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, shards: Sequence[Shard], initial: Sequence[torch.Tensor], weight_decay: float,
                 betas: tuple[float, float], eps: float) -> None:
        self.shards, self.weight_decay, self.betas, self.eps = list(shards), weight_decay, betas, eps
        self.step_count = 0
        self.states = [AdamWState(master, torch.zeros(s.numel, dtype=torch.float32, device=s.params.device),
                                  torch.zeros(s.numel, dtype=torch.float32, device=s.params.device))
                       for s, master in zip(self.shards, initial)]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        for shard, st in zip(self.shards, self.states):
            adamw_flat(st, shard.grad, shard.segments, lr, self.weight_decay, self.betas, self.eps, self.step_count)
            if st.master.data_ptr() != shard.params.data_ptr():
                shard.params.copy_(st.master)

    def state_shards(self) -> list[dict[str, torch.Tensor]]:
        """The master always; the moments once a step has made them (a fresh run saves no zeros)."""
        return [{"master": st.master.float()} if self.step_count == 0 else
                {"master": st.master.float(), "exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq}
                for st in self.states]

    @torch.no_grad()
    def load_state_shards(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        self.step_count = step
        for shard, st, saved in zip(self.shards, self.states, states):
            st.master.copy_(saved["master"])
            st.exp_avg.copy_(saved["exp_avg"])  # zeros for parameters that start fresh
            st.exp_avg_sq.copy_(saved["exp_avg_sq"])
            if st.master.data_ptr() != shard.params.data_ptr():
                shard.params.copy_(st.master)

    def memory_bytes(self) -> dict[str, int]:
        out = {"master": 0, "optimizer": 0}
        for shard, st in zip(self.shards, self.states):
            if shard.params.dtype != torch.float32:  # else the params are their own master
                out["master"] += st.master.numel() * 4
            out["optimizer"] += (st.exp_avg.numel() + st.exp_avg_sq.numel()) * 4
        return out


@torch.no_grad()
def adamw_flat(st: AdamWState, grad: torch.Tensor, segments: Sequence[Segment], lr: float, weight_decay: float,
               betas: tuple[float, float], eps: float, step: int) -> None:
    """One fused AdamW update of a flat shard (see the module doc); the unfused loop elsewhere."""
    if st.master.device.type not in FUSED_ADAMW_DEVICES:
        adamw_flat_unfused(st, grad, segments, lr, weight_decay, betas, eps, step)
        return
    step_t = torch.tensor(float(step), dtype=torch.float32, device=st.master.device)
    for decay in (True, False):
        segs = [s for s in segments if (s.decay and weight_decay != 0.0) == decay]
        if not segs:
            continue
        master, g, m, v = ([t[s.lo:s.hi] for s in segs] for t in (st.master, grad, st.exp_avg, st.exp_avg_sq))
        torch_private.fused_adamw_(master, g, (m, v), [step_t] * len(segs), lr=lr, betas=betas,
                                   weight_decay=weight_decay if decay else 0.0, eps=eps)


@torch.no_grad()
def adamw_flat_unfused(st: AdamWState, grad: torch.Tensor, segments: Sequence[Segment], lr: float,
                       weight_decay: float, betas: tuple[float, float], eps: float, step: int) -> None:
    """The same update as `torch.optim.AdamW(foreach=False)`, op by op (devices without a fused kernel).

    Padding elements have zero gradient and zero moments, so their update is 0 / (0 + eps) = 0.
    """
    beta1, beta2 = betas
    if weight_decay != 0.0:
        for s in segments:
            if s.decay:
                st.master[s.lo:s.hi].mul_(1 - lr * weight_decay)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    # Walk the shard in cache-sized chunks: each chunk's m, v, grad and params stay in cache through the
    # whole update instead of streaming every multi-MB buffer through memory once per operation
    # (elementwise ops, so the result is bit-identical to one pass over the whole shard).
    n = st.master.numel()
    for lo in range(0, n, ADAMW_CHUNK):
        hi = min(n, lo + ADAMW_CHUNK)
        g, m, v, w = grad[lo:hi], st.exp_avg[lo:hi], st.exp_avg_sq[lo:hi], st.master[lo:hi]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-(lr / bias_correction1))
