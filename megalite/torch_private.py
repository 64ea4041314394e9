"""The private torch APIs megalite uses, all in this one module of the base layer, so that every layer may
call them (tests/test_torch_private.py fails, naming the missing API, on a torch that lacks a required one,
and fails if any other module reaches into torch's private names).

- `torch._fused_adamw_`: the kernel behind `torch.optim.AdamW(fused=True)`, called on the flat shards
  directly (`megalite.optim.shard_adamw`): one pass over memory for the whole update.
- the autograd engine's `queue_callback`: runs a function when the current backward pass ends. ZeRO-3
  (`megalite.dp.zero3`) frees every gathered unit there; torch's FSDP does the same.
- `torch._scaled_mm`: the FP8 GEMM (`megalite.fp8.scaled_mm` says which modes this torch supports).
  Needed only with `fp8.recipe`, so it is checked there (`scaled_mm.check_available`), not required here.
- `torch._grouped_mm`: every expert's GEMM in one call (`megalite.moe.grouped`). Optional: without it
  (`HAS_GROUPED_MM` False) the experts run a per-expert loop.
- `UntypedStorage._swap_data_ptr_`: exchanges two storages' memory (pointer and size), every view of each
  following. ZeRO-3 (`megalite.dp.zero3`) lends a unit's flat parameter storage a fixed gather buffer and takes
  it back, instead of allocating and freeing the unit's memory at every gather (FSDP2 reuses its all-gather
  buffers through the CUDA caching allocator; on CPU the heap would keep the churn's holes).
- `torch._C._current_graph_task_id`: -1 outside a backward pass. The MoE layers' statistics
  (`megalite.moe.stats`) skip the forward that full recompute runs again inside the backward; torch's own
  `torch.utils.checkpoint` tells the two apart the same way.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd import Variable

REQUIRED = {
    "torch._fused_adamw_": lambda: torch._fused_adamw_,
    "torch.autograd.Variable._execution_engine.queue_callback": lambda: Variable._execution_engine.queue_callback,
    "torch._C._current_graph_task_id": lambda: torch._C._current_graph_task_id,
    "torch.UntypedStorage._swap_data_ptr_": lambda: torch.UntypedStorage._swap_data_ptr_,  # type: ignore[attr-defined]
}


def missing() -> list[str]:
    """The private APIs above that this torch does not have."""
    out = []
    for name, get in REQUIRED.items():
        try:
            get()
        except AttributeError:
            out.append(name)
    return out


def fused_adamw_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 moments: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]], steps: Sequence[torch.Tensor],
                 lr: float, betas: tuple[float, float], weight_decay: float, eps: float) -> None:
    """AdamW (decoupled decay, no amsgrad) in place on lists of equally shaped fp32 tensors; `moments` are
    (exp_avgs, exp_avg_sqs)."""
    exp_avgs, exp_avg_sqs = moments
    torch._fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], list(steps), lr=lr,
                        beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False,
                        maximize=False)


def swap_storage_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (data pointer and size) of storages `a` and `b`; tensors viewing either follow."""
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward pass now running finishes (call from inside a backward hook)."""
    Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether this code runs inside a backward pass (e.g. a recomputed forward under full recompute)."""
    return torch._C._current_graph_task_id() != -1


HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, weight_t, offs=offs)`: x [N, in] sorted by group, weight_t [E, in, out], offs
    the int32 cumulative row counts -> [N, out]."""
    return torch._grouped_mm(x, weight_t, offs=offs)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm(a, b, scale_a=..., scale_b=..., out_dtype=...)`: (a * scale_a) @ (b * scale_b)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
