"""Grouped expert GEMMs: rows sorted by expert, `counts[e]` rows for expert e, one weight per expert.

`torch._grouped_mm` (a private API, called in `megalite.torch_private`) runs every expert's GEMM in one call where
torch has it (CUDA in bf16; CPU in fp32 and bf16, forward and backward, checked with torch 2.13) and the row strides are
16-byte aligned; elsewhere a loop over the experts computes the same products (`grouped_mm_loop`).
"""

from __future__ import annotations

import torch

from megalite.torch_private import HAS_GROUPED_MM
from megalite.torch_private import grouped_mm as grouped_mm_raw


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (`_grouped_mm`'s backward rejects
    an expanded gradient such as the one `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def can_group(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`_grouped_mm` applies: present, a supported dtype, 16-byte aligned rows of x and of the weights."""
    align = 16 // x.element_size()
    # CUDA's kernel is bf16 only (sm90+); CPU's takes fp32 and bf16. Not yet run on a GPU here.
    dtypes = (torch.float32, torch.bfloat16) if x.device.type == "cpu" else (torch.bfloat16,)
    return (HAS_GROUPED_MM and x.dtype in dtypes and weight.dtype == x.dtype
            and x.shape[1] % align == 0 and weight.shape[1] % align == 0)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ weight[e].T for x [N, in] sorted by expert, weight [E, out, in],
    counts [E] (sum N) -> [N, out], through `torch._grouped_mm`. Fails clearly on a torch without it."""
    if not HAS_GROUPED_MM:
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm: use grouped_mm_loop")
    offs = counts.cumsum(0).to(torch.int32)
    return _ContiguousGrad.apply(grouped_mm_raw(x, weight.transpose(1, 2), offs))


def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same products, one matmul per expert (an expert with no rows contributes nothing)."""
    outs = [part @ weight[e].t() for e, part in enumerate(x.split(counts)) if counts[e]]
    if not outs:  # no rows at all: still a graph through x and every weight (zero gradients, not None)
        return x @ weight[0].t() + 0 * weight.sum()
    return torch.cat(outs)


def expert_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The grouped GEMM where it applies, the loop elsewhere."""
    if can_group(x, weight):
        return grouped_mm(x, weight, torch.tensor(counts, dtype=torch.int64, device=x.device))
    return grouped_mm_loop(x, weight, counts)
