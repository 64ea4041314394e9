"""The gradient sync: the part of ZeRO that wraps the model (Megatron's DistributedDataParallel, FSDP).

It lays this rank's parameters out in flat buckets (`buckets`), repoints every parameter into its
bucket, keeps fp32 "main grad" buffers (Megatron-LM's mixed-precision recipe) and reduces them over each
bucket's group (`ParamSpec.grad_group`, dp x cp for a dense model; buckets never mix groups), at ZeRO
`stage` 0-3 (Rajbhandari et al. 2020):

  stage 0  all-reduce each bucket; the optimizer updates all of it (plain DDP, overlapped).
  stage 1  reduce-scatter each bucket; rank r's optimizer updates its 1/N shard; the updated params are
           all-gathered bucket by bucket (`publish_params`).
  stage 2  as 1, but a bucket's full fp32 gradient buffer is freed once reduce-scattered.
  stage 3  as 2, and each rank stores only 1/N of every unit's params; see `zero3` for the gather/free.

What it hands the optimizer is `shards()` (`megalite.dp.shards.Shard`): per bucket the range this
rank updates, its reduced gradient and which parameter pieces it holds. The optimizer never sees this
class; this class never sees the optimizer's state.

Gradients reach the main grad two ways: a linear's weight gradient is added there by the linear's own
backward (`layers.linear_fn`, Megatron's gradient-accumulation fusion: the linears take a `Fold`), every
other gradient by a per-parameter `post_accumulate_grad` hook. **Readiness is explicit**: backward passes
inside `no_sync()` only accumulate; outside it, each arriving gradient is counted against its bucket
(from zero at `zero_grad`), and a bucket whose every parameter has arrived starts its reduction at once,
overlapping the rest of the backward. The driver runs exactly one gradient pass per parameter outside
`no_sync()` per step (the last micro-batch's; with a split backward its B and its W, each parameter
arriving in one of them); a gradient arriving after its bucket's reduction started is an error, never
a silently lost addition.
`defer_weight_grads(store)` makes the folds record their work in `store` instead of running it: the
zero-bubble schedules' W is then `store.run()`, a plain call (`megalite.pipeline.engine`).

Pipeline parallelism composes through the interface; a tied embedding's two stage copies get buckets
of their own and are summed over the embedding group. What it reads from the model: every parameter's
`ParamSpec` (building fails, naming the parameter, when one has none), the units it is made of (ZeRO-3's
gather units, `megalite.parallel.units.MadeOfUnits`) and the linears that take a fold (`FoldsWeightGrad`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.nn as nn

from megalite.dp.buckets import Bucket, make_bucket, split_by_size
from megalite.dp.overlap import EventSink, OverlapEvent, OverlapSettings, ParamGatherOverlap
from megalite.dp.reduce_grads import unique_params
from megalite.dp.shards import Shard
from megalite.dp.zero3 import Zero3Gatherer, stage3_units, zero3_problems
from megalite.errors import ConfigError
from megalite.layers.linear_fn import DeferredWeightGrads, Fold
from megalite.parallel import comm
from megalite.parallel.param_spec import GradReduction, ParamSpec, spec_table
from megalite.parallel.state import ParallelState
from megalite.parallel.units import MadeOfUnits


@runtime_checkable
class FoldsWeightGrad(Protocol):
    """A layer computing with `weight` through `megalite.layers.linear_fn`, which accepts a fold: its
    backward then adds dW into the buffer view the fold hands it instead of producing `weight.grad`."""

    weight: nn.Parameter

    def set_wgrad_fold(self, fold: Fold | None) -> None: ...


Params = list[nn.Parameter]


def by_group(params: Params, specs: dict[nn.Parameter, ParamSpec]) -> list[Params]:
    """`params` split by their `GradReduction`, order kept within each (in order of first appearance)."""
    groups: dict[GradReduction, Params] = {}
    for p in params:
        groups.setdefault(specs[p].grads, []).append(p)
    return list(groups.values())


def _add(grad: torch.Tensor, main: torch.Tensor) -> None:
    main.add_(grad)


class GradSync:
    """Main-grad buffers, bucketed reductions and parameter gathers for this rank's model `chunks`."""

    def __init__(self, chunks: Sequence[nn.Module], state: ParallelState, stage: int, dtype: torch.dtype,
                 settings: OverlapSettings = OverlapSettings(), on_event: EventSink | None = None,
                 fold_weight_grads: bool = True) -> None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero={stage} is not a ZeRO stage: use 0, 1, 2 or 3")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"train.dtype {dtype} unsupported: use fp32, bf16 or fp16")
        if stage > 0 and state.size("dp_cp") == 1:  # every gradient group lies inside dp x cp
            warnings.warn(f"parallel.zero={stage} with dp=1 has nothing to shard: using zero=0 "
                          "(plain data parallel). Set parallel.zero=0 to silence this.", stacklevel=3)
            stage = 0
        model = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        self.model, self.state, self.stage, self.dtype = model, state, stage, dtype
        self.settings, self._on_event = settings, on_event
        self._sync = True
        self._deferred: DeferredWeightGrads | None = None
        self.specs = spec_table(model, ConfigError)
        params = unique_params(model)
        shared = [p for p in params if self.specs[p].pipeline_tied] if state.pp > 1 else []
        problems = zero3_problems(stage, len(chunks), bool(shared))
        if problems:
            raise ConfigError(problems[0])
        if stage == 3 and not isinstance(model, MadeOfUnits):
            raise ConfigError(f"parallel.zero=3 needs a model that names the units it is made of (units()), "
                              f"which ZeRO-3 gathers one at a time; {type(model).__name__} does not")
        self._names = {id(p): n for n, p in reversed(list(model.named_parameters()))}
        self._fp32: list[torch.Tensor] = []  # each bucket's own fp32 values before the cast (`take_fp32_values`)
        self.zero3: Zero3Gatherer | None = None
        if stage == 3 and isinstance(model, MadeOfUnits):
            blocks, outer = stage3_units(model, model.units(), params)
            units = ([outer] if outer else []) + blocks
            built = [(m, [self._build_bucket(g) for g in by_group(ps, self.specs)]) for m, ps in units]
            self.buckets = [b for _, bs in built for b in bs]
            self._shared_buckets: list[Bucket] = []
            self.zero3 = Zero3Gatherer(built[1:] if outer else built, built[0] if outer else None, state,
                                       settings.zero3_prefetch)
        else:
            # Reverse registration order ~ the order gradients become ready in backward.
            # A tied embedding's two pipeline copies each get a bucket of their own, so both stages
            # shard them identically and their reduced grads can be summed over the embedding group.
            rest = [p for p in params if all(p is not q for q in shared)]
            groups = [[p] for p in shared] + [g for ps in by_group(rest[::-1], self.specs)
                                              for g in split_by_size(ps, settings.bucket_bytes,
                                                                     settings.first_bucket_bytes)]
            self.buckets = [self._build_bucket(g) for g in groups]
            self._shared_buckets = self.buckets[:len(shared)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._position = {id(b): i for i, b in enumerate(self.buckets)}
        self._param_sync = (ParamGatherOverlap(model, self.buckets, state, settings.param_gather, on_event)
                            if stage in (1, 2) else None)
        # `model.compile` passes False: a fold mutates this sync from inside the linear's backward, which
        # dynamo cannot trace (a graph break at every linear), so compiled blocks take the hook path.
        folded = self._register_folds(model) if fold_weight_grads else set()
        for p in params:
            p.register_post_accumulate_grad_hook(self._check_folded if id(p) in folded else self._on_grad)

    # ------------------------------------------------------------ construction
    def _register_folds(self, model: nn.Module) -> set[int]:
        """Give every linear whose weight it alone uses a fold into the main grad: its backward adds dW
        there itself (`layers.linear_fn`), no `.grad` tensor, no hook. A weight shared with another
        module (a tied embedding/head) keeps the `.grad` + hook path. Returns the folded params' ids."""
        owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        folded: set[int] = set()
        for m in model.modules():
            if isinstance(m, FoldsWeightGrad) and m.weight.requires_grad and owners[id(m.weight)] == 1:
                m.set_wgrad_fold(functools.partial(self._fold_weight, m.weight))
                folded.add(id(m.weight))
        return folded

    def _build_bucket(self, params: Params) -> Bucket:
        group = self.specs[params[0]].grad_group
        st = self.state
        b, full32 = make_bucket(params, self.specs, st.size(group), st.rank_in(group), pad=self.stage > 0)
        b.param_flat = full32.to(self.dtype)
        for p, off in zip(params, b.offsets):
            p.data = b.param_flat[off:off + p.numel()].view(p.shape)
        if self.stage == 3:
            b.param_shard = b.param_flat[b.lo:b.hi].clone()
        # fp32: the params are their own master weights (no copy); else the fp32 values before the cast.
        self._fp32.append(b.own_params() if self.dtype == torch.float32 else full32[b.lo:b.hi].clone())
        if self.stage <= 1:  # a persistent fp32 main-grad buffer
            b.grad_flat = torch.zeros(b.padded, dtype=torch.float32, device=st.device)
            b.grad_shard = b.grad_flat[b.lo:b.hi]
        else:
            b.grad_shard = torch.zeros(b.shard_numel, dtype=torch.float32, device=st.device)
        return b

    def shards(self) -> list[Shard]:
        """What the optimizer updates: each bucket's own range (the same tensors for the whole run)."""
        return [b.shard(self.stage > 0) for b in self.buckets]

    def take_fp32_values(self) -> list[torch.Tensor]:
        """Each shard's parameters in fp32 as they were before the cast to the model dtype (the masters'
        starting values; the `params` themselves in fp32). Once: the sync keeps no reference."""
        out, self._fp32 = self._fp32, []
        return out

    # ------------------------------------------------------------ gradients in
    def _on_grad(self, p: torch.Tensor) -> None:
        """A fresh `.grad` (post-accumulate hook): add it to the fp32 main grad and drop it."""
        grad = p.grad
        assert grad is not None
        p.grad = None
        self._fold(p, functools.partial(_add, grad))

    def _check_folded(self, p: torch.Tensor) -> None:
        """A folded weight never gets a `.grad`: one here means a code path skipped the fold (and the
        gradient would be lost), so fail loudly."""
        if p.grad is not None:
            raise RuntimeError(f"{self._names.get(id(p), 'a parameter')}: got a .grad although its linear "
                               "adds the weight gradient to the gradient sync's buffer (layers.linear_fn)")

    def _fold_weight(self, p: torch.Tensor, accumulate: Callable[[torch.Tensor], None]) -> None:
        """A linear's fold: add its weight gradient now, or record it for a later W."""
        if self._deferred is not None:
            self._deferred.add(functools.partial(self._fold, p, accumulate))
        else:
            self._fold(p, accumulate)

    def _fold(self, p: torch.Tensor, accumulate: Callable[[torch.Tensor], None]) -> None:
        """`accumulate` adds a gradient of `p` into the fp32 main-grad view it is given; outside
        `no_sync()` that counts `p` as arrived, and its bucket's reduction starts once all have."""
        b = self._bucket_of[id(p)]
        if b.launched:
            raise RuntimeError(f"{self._names.get(id(p), 'a parameter')}: a gradient arrived after its bucket's "
                               "reduction started: run every backward pass but the step's last inside no_sync()")
        if b.grad_flat is None:
            b.grad_flat = torch.zeros(b.padded, dtype=torch.float32, device=self.state.device)
        off = b.offsets[b.index[id(p)]]
        accumulate(b.grad_flat[off:off + p.numel()].view(p.shape))
        if self.zero3 is not None:
            b.unit_ready += 1
            if b.unit_ready == b.n_grads:  # the unit's backward is done with these parameters
                self.zero3.free(b)
        if self._sync:
            b.ready += 1
            if b.ready == b.n_grads:
                self._launch(b)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @contextlib.contextmanager
    def defer_weight_grads(self, store: DeferredWeightGrads) -> Iterator[None]:
        """Backward passes inside record the linears' weight-gradient work in `store` (run by `store.run()`)."""
        self._deferred = store
        try:
            yield
        finally:
            self._deferred = None

    # ------------------------------------------------------------ reductions
    def _launch(self, b: Bucket) -> None:
        """Start this bucket's reduction over its group (all-reduce at stage 0, reduce-scatter otherwise)."""
        if b.launched:
            return
        if b.grad_flat is None:  # no parameter of the bucket got a gradient this step
            b.grad_flat = torch.zeros(b.padded, dtype=torch.float32, device=self.state.device)
        b.launched = True
        if self._on_event is not None:
            self._on_event(OverlapEvent("reduce", self._position[id(b)]))
        if self.stage == 0:
            b.work = comm.all_reduce_async(b.grad_flat, self.state, b.group)
        else:
            b.scatter_out = torch.empty(b.shard_numel, dtype=torch.float32, device=self.state.device)
            b.work = comm.reduce_scatter_async(b.scatter_out, b.grad_flat, self.state, b.group)

    def zero_grad(self) -> None:
        for b in self.buckets:
            if self.stage <= 1:
                assert b.grad_flat is not None
                b.grad_flat.zero_()
            else:
                b.grad_flat = None
                assert b.grad_shard is not None
                b.grad_shard.zero_()
            b.launched, b.ready, b.work, b.scatter_out = False, 0, None, None

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (starting any that never filled), average over its group
        (divided by its `GradReduction.divisor_group`'s size), then sum the SP-partial pieces over TP (the
        average and the TP sum commute)."""
        for b in self.buckets:
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work = None
            assert b.grad_shard is not None and b.grad_flat is not None
            if self.stage >= 1:
                assert b.scatter_out is not None
                b.grad_shard.copy_(b.scatter_out)
                b.scatter_out = None
            n = self.state.size(b.grads.divisor_group)  # the group's average; dp x cp for experts (see there)
            if n > 1:  # a full pass over the gradients: skip it when alone
                b.grad_shard.div_(n)
            if self.stage >= 2:
                b.grad_flat = None  # ZeRO-2: only the reduced shard is kept
        for b in self._shared_buckets:  # Megatron's tied-embedding sync (first and last stage)
            assert b.grad_shard is not None
            comm.all_reduce(b.grad_shard, self.state, "embedding")
        if self.state.tp > 1:
            pieces = [(shard.grad, s) for shard in self.shards() for s in shard.segments if s.sp_partial]
            if pieces:
                flat = torch.cat([g[s.lo:s.hi] for g, s in pieces])
                comm.all_reduce(flat, self.state, "tp")
                off = 0
                for g, s in pieces:
                    g[s.lo:s.hi].copy_(flat[off:off + s.hi - s.lo])
                    off += s.hi - s.lo

    # ------------------------------------------------------------ parameters out
    @torch.no_grad()
    def publish_params(self, wait: bool = True) -> None:
        """Make every rank's updated shard visible in the model (stages 1-2: all-gather each bucket; with
        `wait=False` the next forward waits for its buckets). Stage 3 gathers per unit when used."""
        if self._param_sync is not None:
            self._param_sync.launch()
            if wait:
                self._param_sync.finish()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers still in flight (ZeRO-1/2 overlaps them with the next
        forward); call before reading the parameters outside a forward."""
        if self._param_sync is not None:
            self._param_sync.finish()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every parameter whole and current (stage 3 gathers every unit, stages 1-2 wait for their
        pending gathers), e.g. while a checkpoint is loaded into them or a sample is generated."""
        self.finish_param_sync()
        if self.zero3 is None:
            yield
            return
        for b in self.zero3.units():
            self.zero3.gather(b)
        try:
            yield
        finally:
            self.zero3.free_all()

    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes of parameters and gradients this rank holds now (from the tensors)."""
        out = {"params": 0, "grads": 0}
        for b in self.buckets:
            out["params"] += b.param_flat.untyped_storage().nbytes()  # 0 while a stage-3 unit is freed
            if b.param_shard is not None:
                out["params"] += b.param_shard.numel() * b.param_shard.element_size()
            if b.grad_flat is not None:
                out["grads"] += b.grad_flat.numel() * 4
            if self.stage >= 2:  # its own tensor; at stages 0-1 it is a view of grad_flat
                assert b.grad_shard is not None
                out["grads"] += b.grad_shard.numel() * 4
        return out

    def names(self) -> dict[int, str]:
        """id(parameter) -> its name in the wrapped model."""
        return dict(self._names)
