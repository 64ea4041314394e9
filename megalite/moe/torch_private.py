"""The private torch API the MoE layers use, in one place (as `megalite.optim.torch_private` is for the
optimizer's; this package sits below optim, so it keeps its own):

- `torch._grouped_mm`: every expert's GEMM in one call (`megalite.moe.grouped`). Optional: without it
  (`HAS_GROUPED_MM` False) the experts run a per-expert loop; tests/test_moe_layer.py names it if missing.
"""

from __future__ import annotations

import torch

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm_raw(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, weight_t, offs=offs)`: x [N, in] sorted by group, weight_t [E, in, out], offs
    the int32 cumulative row counts -> [N, out]."""
    return torch._grouped_mm(x, weight_t, offs=offs)
