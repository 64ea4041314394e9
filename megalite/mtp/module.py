"""The multi-token prediction modules and their losses (DeepSeek-V3, Liu et al. 2024, section 2.2; docs/mtp.md).

Depth k = 1..D predicts, at every position i, the token k+1 ahead (t_{i+k+1}; the main model predicts t_{i+1}):

    h'_i = eh_proj( [enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)] )     [B, S, 2H] -> [B, S, H]
    h^k  = Block_k(h')                                             the model's own block class (MoE too)
    loss_k = CE( Head(norm_k(h^k_i)), t_{i+k+1} )                  shared embedding and output head

h^0 is the main model's last hidden state (before its final norm). The order of the concatenation is
DeepSeek's released code's (eh_proj takes cat(enorm(emb), hnorm(h))). The tokens are shifted on the whole
sequence: position i takes ids[i+k] and the label labels[i+k] (= ids[i+k+1]); the last k positions have none
(ids rolled around, labels -100, so they carry no loss, and causal attention keeps them from every earlier
position). Under context parallelism a rank's zigzag split lacks its neighbours' tokens, so the ids and labels
are all-gathered over cp (int64, counted under 'cp'), shifted whole, and split again.

The training loss gains lambda / D x sum_k loss_k, each loss_k the mean over the micro-batch's labelled positions;
it reaches the backward as the MoE router losses do (`moe.losses.attach`, on the main loss tensor, scaled like
the micro-batch's loss), so the reported loss stays the main model's and each depth's is logged on its own.

Tensor parallelism: eh_proj is replicated (each tp rank projects the tokens it holds: all of them, or its SP
slice), which needs no collective at the cost of tp copies of a 2H x H GEMM per depth; the norms are replicated
as the block's; the block is tensor-parallel as any block. The embedding the modules read on the last pipeline
stage is the first stage's, shared the way a tied embedding is (`Tied.HEAD_COPY`, summed over the 'embedding'
group): the tied head itself, or a copy of the embedding when the head is untied.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from megalite.context.documents import DocumentIds, documents
from megalite.context.zigzag import zigzag_merge, zigzag_split
from megalite.layers.init import full_normal
from megalite.moe.losses import attach
from megalite.parallel import comm
from megalite.parallel.param_spec import REPLICATED, ParamSpec, children_specs
from megalite.parallel.state import ParallelState
from megalite.torch_private import in_backward

IGNORE_INDEX = -100

Embed = Callable[[torch.Tensor], torch.Tensor]            # ids [B, S'] -> [B, S'(/tp under SP), H]
BlockFn = Callable[..., torch.Tensor]


class MTPDepth(nn.Module):
    """One MTP module (hub names: enorm, hnorm, eh_proj, the block's, shared_head.norm as `norm`)."""

    def __init__(self, hidden: int, make_norm: Callable[[], nn.Module], block: nn.Module, state: ParallelState,
                 name: str, seed: int, std: float) -> None:
        super().__init__()
        self.sp = state.sp
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Parameter(full_normal((hidden, 2 * hidden), std, seed, f"{name}.eh_proj"))
        self.block = block
        self.norm = make_norm()

    def param_specs(self) -> dict[str, ParamSpec]:
        # Replicated over tp; under SP each tp rank projects its own slice of the sequence: partial sums.
        return {**children_specs(self), "eh_proj": ParamSpec(REPLICATED, sp_partial=self.sp)}

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h^k), h^k): the head's input first, then the next depth's (every weight of the module is used
        inside its forward: ZeRO-3 gathers a unit around its forward and its backward). `docs`: document masking,
        the block attending within each document as the main model's do."""
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1) @ self.eh_proj.to(h.dtype).t()
        h = self.block(x, cos, sin, docs)
        return self.norm(h), h


def shifted_tokens(ids: torch.Tensor, labels: torch.Tensor, depths: int, state: ParallelState,
                   eod: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) for depths 1..D on this rank's tokens: position i gets ids[i+k] and labels[i+k] of the whole
    sequence; the last k positions are unlabelled (-100). Under document masking (`eod`, the token ending each
    document) so is every position whose token k ahead lies in another document: depth k would combine two
    documents there (a document's last token, the EOD, keeps its label as in the main model)."""
    cp = state.cp
    if cp > 1:  # the whole sequences: every cp rank's zigzag split, merged
        both = comm.all_gather(torch.stack([ids, labels]).contiguous(), state, "cp", dim=0)
        whole = zigzag_merge(list(both.chunk(cp, dim=0)), dim=2)
        ids, labels = whole[0], whole[1]
    doc = documents(ids, eod).ids if eod is not None else None
    out = []
    for k in range(1, depths + 1):
        ids_k, labels_k = ids.roll(-k, dims=1), labels.roll(-k, dims=1).clone()
        labels_k[:, -k:] = IGNORE_INDEX
        if doc is not None:  # positions j <= i of i's document never cross when i does not: nothing leaks
            labels_k[doc.roll(-k, dims=1) != doc] = IGNORE_INDEX
        if cp > 1:
            ids_k, labels_k = zigzag_split(ids_k, cp, state.cp_rank), zigzag_split(labels_k, cp, state.cp_rank)
        out.append((ids_k, labels_k))
    return out


class MultiTokenPrediction(nn.Module):
    """The D modules of the last stage, their loss and what they record for the step's metrics."""

    def __init__(self, depths: list[MTPDepth], loss_weight: float, state: ParallelState,
                 embedding: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(depths)
        # The last stage's copy of the first stage's embedding (pipeline, untied head), else None.
        self.embedding = embedding
        self.loss_weight, self.state = loss_weight, state
        self.reset()

    def reset(self) -> None:
        self.sums = [0.0] * len(self.layers)  # per depth: the sum over micro-batches of its mean loss
        self.micro = 0

    def hidden(self, h: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, embed: Embed, cos: torch.Tensor,
               sin: torch.Tensor, docs: DocumentIds | None = None,
               eod: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(norm_k(h^k), its labels) for k = 1..D from the main model's last hidden state h^0 [B, S', H]. The
        caller runs the shared head once over these and the main hidden state together (one GEMM; a linear
        that folds its weight gradient is called once per backward). Document masking: `docs` and `eod`."""
        out = []
        shifted = shifted_tokens(ids, labels, len(self.layers), self.state, eod)
        for layer, (ids_k, labels_k) in zip(self.layers, shifted):
            normed, h = layer(h, embed(ids_k).to(h.dtype), cos, sin, docs)
            out.append((normed, labels_k))
        return out

    def add_loss(self, loss: torch.Tensor, token_losses: list[torch.Tensor], labels: list[torch.Tensor],
                 scale: float) -> torch.Tensor:
        """The main per-token loss [B, S'] with lambda / D x sum_k loss_k attached to its backward (x `scale`, the
        micro-batch's loss factor), from each depth's per-token losses and labels; records each depth's loss."""
        st, d = self.state, len(self.layers)
        # Each depth's loss sum and labelled positions over the micro-batch: summed over the cp ranks.
        stat = torch.stack([torch.stack([t.detach().sum().double() for t in token_losses]),
                            torch.stack([(t != IGNORE_INDEX).sum().double() for t in labels])])
        comm.all_reduce(stat, st, "cp", count_as="metrics")
        n = stat[1].clamp(min=1)
        if not in_backward():
            self.sums = [a + float(v) for a, v in zip(self.sums, (stat[0] / n).tolist())]
            self.micro += 1
        # This rank's share (x cp: the step divides every gradient by cp once more than a share needs).
        share = torch.stack([t.sum() / n[k].float() for k, t in enumerate(token_losses)]).sum()
        return attach(loss, share * (self.loss_weight / d * st.cp), scale)
