"""Tokens to their experts and back: the local permutation and the expert-parallel all-to-all.

Each token's k assignments are sorted by expert (stable, so the order is a function of the tokens
only). Under expert parallelism the experts are split in contiguous blocks over the 'ep' ranks: every
rank first exchanges how many rows it sends each expert (a small all-to-all of counts), then the rows
themselves (an all-to-all of variable split sizes: a rank may send or receive none), reorders what it
received from (source, expert) to expert-major order for the grouped GEMM, and the combine sends the
outputs back the same way. Routing weights are applied on the token's own rank, after the combine,
so the router's gradient never crosses the all-to-all. Optional capacity: an expert keeps at most
ceil(factor * T * k / E) of this rank's assignments (in token order), the rest are dropped (their
weight is lost; the residual carries the token), and counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite.parallel import comm
from megalite.parallel.state import ParallelState


@dataclass
class DispatchPlan:
    token_of: torch.Tensor      # [N] the token of each kept assignment, in expert-sorted order
    slot: torch.Tensor          # [N] its index into the flattened [T * k] routing weights
    send: list[int]             # rows sent to each ep rank
    recv: list[int]             # rows received from each ep rank
    local_counts: list[int]     # rows per local expert after the exchange
    perm: torch.Tensor | None   # received (source, expert) order -> expert-major order (None when ep = 1)
    dropped: int                # assignments over capacity on this rank
    sources: list[list[int]] | None = None  # [local expert][source ep rank]: its rows from each (None when ep = 1)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    return math.ceil(factor * tokens * top_k / experts)


def dispatch(x: torch.Tensor, experts: torch.Tensor, num_experts: int, state: ParallelState,
             capacity_factor: float | None) -> tuple[torch.Tensor, DispatchPlan]:
    """x [T, H], experts [T, k] -> (this rank's expert inputs [N', H] sorted by local expert, the plan)."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    dropped = 0
    if capacity_factor is not None:
        cap = capacity(t, k, num_experts, capacity_factor)
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = flat[order]
        position = torch.arange(order.numel(), device=x.device) - starts[sorted_experts]
        keep = position < cap
        dropped = int((~keep).sum())
        order = order[keep]
        counts = counts.clamp(max=cap)
    token_of = order // k
    rows = x[token_of]
    ep = state.size("ep")
    if ep == 1:
        return rows, DispatchPlan(token_of, order, [rows.shape[0]], [rows.shape[0]], counts.tolist(), None, dropped)
    local = num_experts // ep
    # Each rank tells every other how many rows it sends to each of that rank's experts.
    recv_counts = comm.all_to_all_single(counts.view(ep, local), state, "ep", [1] * ep, [1] * ep)
    send = counts.view(ep, local).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    received = comm.all_to_all_rows(rows, state, "ep", send, recv)
    segment = torch.repeat_interleave(torch.arange(ep * local, device=x.device), recv_counts.reshape(-1))
    perm = torch.argsort(segment % local, stable=True)
    plan = DispatchPlan(token_of, order, send, recv, recv_counts.sum(0).tolist(), perm, dropped,
                        recv_counts.t().tolist())
    return received[perm], plan


def combine(y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor, tokens: int, state: ParallelState) -> torch.Tensor:
    """The experts' outputs [N', H] (expert-major) back to [T, H]: sum over each token's assignments of
    weight x output, in expert order."""
    if plan.perm is not None:
        back = torch.empty_like(plan.perm)
        back[plan.perm] = torch.arange(plan.perm.numel(), device=plan.perm.device)
        y = comm.all_to_all_rows(y[back], state, "ep", plan.recv, plan.send)
    w = weights.reshape(-1)[plan.slot].to(y.dtype)
    out = y.new_zeros((tokens, y.shape[1]))
    return out.index_add(0, plan.token_of, y * w[:, None])
