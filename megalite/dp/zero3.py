"""ZeRO stage 3 parameter life cycle: gather a module's weights just before use, free them right after.

Each *unit* (each module the model is made of, `MadeOfUnits.units()`: a GPT's transformer blocks, plus one
"outer" unit with everything else on the stage: embedding, learned positions, final norm, head) is one
flat bucket per gradient group (`ParamSpec.grad_group`; one for a dense model) whose full buffer exists
only while the unit computes (Rajbhandari et al. 2020, "ZeRO",
section 5.3; PyTorch FSDP's FlatParameter).
The model's parameters stay the same `nn.Parameter` objects, viewing the full buffer; "freeing" resizes
the buffer's storage to 0 bytes, and gathering resizes it back and all-gathers into it. Tensors that
autograd saved (e.g. the weight of a linear) share that storage, so re-gathering before the backward
makes them valid again — the model code needs no change.

Forward: pre-hook gathers the unit (waiting on a prefetch if one is in flight) and prefetches the
next `prefetch` blocks (`parallel.zero3_prefetch`, default 1; 0 = gather each unit only when it is
needed); post-hook frees it and registers a hook on the output's gradient, which fires just before
the unit's backward: gather again (prefetching the previous `prefetch` blocks). The depth changes only
when gathers start, never what is gathered: the bytes and the results are the same for every depth;
the memory held grows by one unit per step of depth. When every parameter of a bucket has its
gradient since the bucket was gathered (counted by the gradient sync), it is freed. A callback at the
end of the backward (`torch_private.at_end_of_backward`) frees anything left.

The gathered memory comes from fixed buffers (`GatherBuffers`), one per unit gathered at once (the block
computing, the `prefetch` blocks ahead, the outer unit), reused across units and steps: a unit's storage
borrows a buffer of its size at the gather and gives it back at the free (`torch_private.swap_storage_memory`),
as FSDP2's all-gather buffers are reused, so a step allocates no parameter memory and leaves no holes in the heap.

The outer unit is hooked on the model itself (not on the embedding/head separately) because GPT reads
`self.position` directly in `embed()` and, with tied embeddings, the head reuses the embedding's
weight: keeping the outer unit gathered over the stage's whole forward gathers it exactly once per
forward and once per backward, which keeps the 3 Psi communication volume exact.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from megalite import torch_private
from megalite.dp.buckets import Bucket
from megalite.dp.overlap import ahead
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Buckets = list[Bucket]  # one unit's buckets (one per gradient group)


class GatherBuffers:
    """Full-unit buffers lent to the units' flat storages while they are gathered, by byte size: the pool holds
    as many of a size as were ever gathered at once, and a step after the first allocates none."""

    def __init__(self) -> None:
        self._idle: dict[tuple[int, torch.device], list[torch.UntypedStorage]] = {}
        self._lent: set[int] = set()  # storages (by id) now holding a pool buffer

    def lend(self, storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> None:
        """Give empty `storage` a buffer of `nbytes` (an idle one, or a new one)."""
        idle = self._idle.setdefault((nbytes, device), [])
        buffer = idle.pop() if idle else torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        torch_private.swap_storage_memory(storage, buffer)  # `buffer` is left with the empty memory
        self._lent.add(id(storage))

    def release(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        """Empty `storage`: a lent buffer goes back to the pool; memory of its own (the unit's first, from
        construction) is freed."""
        if id(storage) not in self._lent:
            storage.resize_(0)
            return
        self._lent.discard(id(storage))
        buffer = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        torch_private.swap_storage_memory(storage, buffer)
        self._idle.setdefault((buffer.nbytes(), device), []).append(buffer)

    def idle_bytes(self) -> int:
        """Bytes of the buffers no unit holds now."""
        return sum(b.nbytes() for bs in self._idle.values() for b in bs)


class Zero3Gatherer:
    """Installs the gather/free hooks for `units` = [(module, its buckets)] in forward order."""

    def __init__(self, units: list[tuple[nn.Module, Buckets]], outer: tuple[nn.Module, Buckets] | None,
                 state: ParallelState, prefetch: int = 1) -> None:
        self.state = state
        self.blocks = units
        self.outer = outer
        self.prefetch = prefetch  # units gathered ahead of the one computing
        self.in_backward = False
        self.buffers = GatherBuffers()
        self._handles: list[Any] = []
        all_units = ([outer] if outer else []) + units
        for i, (module, buckets) in enumerate(all_units):
            is_outer = outer is not None and i == 0
            nxt = self._neighbours(i - (outer is not None), is_outer, +1)
            prev = self._neighbours(i - (outer is not None), is_outer, -1)
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(buckets, nxt)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(buckets, prev)))
        self.free_all()

    def _neighbours(self, block: int, is_outer: bool, step: int) -> Buckets:
        """The buckets of the blocks that run next after unit `block`, `prefetch` of them: +1 in forward
        order, -1 in backward order."""
        blocks = [bs for _, bs in self.blocks]
        if is_outer:
            # The outer unit wraps the stage: forward starts at the first block, backward at the last.
            block = -1 if step > 0 else len(blocks)
        return [b for bs in ahead(blocks, block, step, self.prefetch) for b in bs]

    def units(self) -> Buckets:
        """Every bucket, the outer unit's first."""
        return [b for _, bs in ([self.outer] if self.outer else []) + self.blocks for b in bs]

    # ------------------------------------------------------------ gather / free
    def is_gathered(self, b: Bucket) -> bool:
        return b.param_flat.untyped_storage().nbytes() > 0

    def gather(self, b: Bucket, wait: bool = True) -> None:
        """All-gather the unit's full parameters into its flat buffer (async when wait=False)."""
        if not self.is_gathered(b):
            self.buffers.lend(b.param_flat.untyped_storage(), b.padded * b.param_flat.element_size(),
                              b.param_flat.device)
            assert b.param_shard is not None
            b.unit_ready = 0  # its gradients of this backward are all still to come
            b.gather_work = comm.all_gather_async(b.param_flat, b.param_shard, self.state, b.group)
        if wait and b.gather_work is not None:
            b.gather_work.wait()
            b.gather_work = None

    def free(self, b: Bucket) -> None:
        if b.gather_work is not None:  # a prefetch that was never used: finish it before freeing
            b.gather_work.wait()
            b.gather_work = None
        self.buffers.release(b.param_flat.untyped_storage(), b.param_flat.device)

    def free_all(self) -> None:
        for b in self.units():
            self.free(b)

    def gather_unit(self, buckets: Sequence[Bucket], wait: bool = True) -> None:
        for b in buckets:
            self.gather(b, wait=False)
        if wait:
            for b in buckets:
                self.gather(b)

    # ------------------------------------------------------------ hooks
    def _make_pre_forward(self, unit: Buckets, nxt: Buckets) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.gather_unit(unit)
            if not self.in_backward:  # no prefetch while recomputing (full recompute)
                self.gather_unit(nxt, wait=False)
        return hook

    def _make_post_forward(self, unit: Buckets, prev: Buckets) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.in_backward:  # a recomputed forward inside backward: its backward follows at once
                return
            for b in unit:
                self.free(b)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._make_pre_backward(unit, prev))
        return hook

    def _make_pre_backward(self, unit: Buckets, prev: Buckets) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.in_backward:
                self.in_backward = True
                torch_private.at_end_of_backward(self.end_of_backward)
            self.gather_unit(unit)
            self.gather_unit(prev, wait=False)
        return hook

    def end_of_backward(self) -> None:
        self.in_backward = False
        self.free_all()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


Unit = tuple[nn.Module, list[nn.Parameter]]


def zero3_problems(stage: int, chunks_per_rank: int, pipeline_tied: bool) -> list[str]:
    """What ZeRO-3 does not support yet, one line each (empty: fine). The one place these limits live:
    `config.validate` reports them before anything starts, the gradient sync refuses to build with them.
    Its hooks sit on one model chunk (whose units it names); a tied embedding's pipeline copies are two
    parameters that would each need their own gathered unit on two stages."""
    if stage != 3:
        return []
    out = []
    if chunks_per_rank > 1:
        out.append("parallel.zero=3 with parallel.vpp > 1 (several model chunks per rank) is not supported yet: "
                   "use parallel.zero<=2 with the interleaved schedule, or vpp=1")
    if pipeline_tied:
        out.append("parallel.zero=3 with pp > 1 and tied embeddings is not supported yet: set "
                   "model.tie_embeddings=false or use parallel.zero<=2")
    return out


def stage3_units(model: nn.Module, blocks: list[nn.Module], params: list[nn.Parameter]) -> tuple[
        list[Unit], Unit | None]:
    """ZeRO-3's gather units: one per unit the model is made of (`blocks` = `MadeOfUnits.units()`), with its
    parameters among `params`, plus the rest of the model as the outer unit."""
    in_block = {id(p) for blk in blocks for p in blk.parameters()}
    units = [(blk, [p for p in params if id(p) in {id(q) for q in blk.parameters()}]) for blk in blocks]
    rest = [p for p in params if id(p) not in in_block]
    return [u for u in units if u[1]], ((model, rest) if rest else None)
