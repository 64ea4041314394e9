"""The ZeRO optimizer, stages 0-3, with mixed precision (Rajbhandari et al. 2020, "ZeRO").

One class implements the `DistributedOptimizer` protocol (`megalite.optim.protocol`) for all stages.
Parameters are laid out in flat buckets (`zero_buckets`); for stages >= 1 each bucket is padded to a
multiple of dp and rank r owns the contiguous 1/dp of it. Gradients are accumulated in fp32
"main_grad" buffers (Megatron-LM's mixed-precision recipe), whatever the model dtype: a linear's
weight gradient is added there by the linear's own backward (`layers.linear_fn`, Megatron's
gradient-accumulation fusion), every other gradient by a per-parameter `post_accumulate_grad` hook. When the last parameter of a bucket gets its
gradient in the *last* micro-batch's backward (not inside `no_sync()`), the bucket's DP reduction
starts asynchronously, overlapping the rest of the backward; `finish_grad_sync()` waits for all of them.

  stage 0  all-reduce each bucket; every rank updates everything (plain DDP, overlapped).
  stage 1  reduce-scatter each bucket; rank r updates its 1/dp shard of fp32 master weights and Adam
           moments; the updated params are all-gathered (bucket by bucket).
  stage 2  as 1, but the full fp32 gradient buffer of a bucket is freed as soon as it is reduce-scattered:
           only the reduced 1/dp shard is kept.
  stage 3  as 2, and each rank stores only 1/dp of every unit's params; see `zero3` for the gather/free.

Exact bytes held per rank, measured by `memory_bytes()` after a step (Psi = elements of this rank's TP
shard of the model, each shared parameter once; P = Psi padded: sum over buckets of ceil(n_b/N)*N,
P = Psi for stage 0; N = dp x cp, GRAD_GROUP; b = 4 for fp32, 2 for bf16/fp16):

               params     grads (fp32)   master (fp32)    Adam m, v (fp32)
    stage 0    b Psi      4 Psi          4 Psi or 0       8 Psi
    stage 1    b P        4 P            4 P/N or 0       8 P/N
    stage 2    b P        4 P/N          4 P/N or 0       8 P/N
    stage 3    b P/N      4 P/N          4 P/N or 0       8 P/N

"or 0": in fp32 the params are their own master weights (the master shard is a view of them). So fp32
is (4+4+8) = 16 bytes/element before sharding, bf16 (2+4+4+8) = 18: megalite keeps fp32 gradients
(accumulation over micro-batches in bf16 loses bits), where the ZeRO paper's K=12 formula has 2-byte
gradients. While a stage-2/3 backward runs, a bucket's full fp32 grad buffer exists until it is reduced,
and stage 3 holds the full params of the units being computed (and `parallel.zero3_prefetch` prefetched
units). When each collective runs (bucket sizes, the parameter-gather overlap, ZeRO-3's prefetch) is
`megalite.optim.overlap`'s business; the results do not depend on it.

DP bytes per step (the `CommCounter` convention, M micro-batches):
    stage 0      all-reduce of the fp32 grads:          2 (N-1)/N * 4 Psi   (one all-reduce per bucket)
    stage 1, 2   reduce-scatter fp32 grads + all-gather params:  (N-1)/N * (4 P + b P)
                 (= 2 (N-1)/N * 4 P in fp32: the same volume as DDP, padding included)
    stage 3      all-gather params before each forward and each backward, reduce-scatter grads once:
                 (N-1)/N * (2 M b P + 4 P)   (= 3 (N-1)/N * 4 P in fp32 with M = 1: 1.5x DDP)
The gradient-norm all-reduce over dp (one fp64 scalar) is counted under "norm", not "dp".

zero > 0 with dp = 1 has nothing to shard: it falls back to stage 0 with one warning.
Pipeline parallelism composes through the interface (`no_sync`, `finish_grad_sync`; a tied embedding's
two stage copies get buckets of their own and are summed over the embedding group). Stage 3 works with
pp > 1 when each rank holds one chunk (vpp = 1) and the embeddings are untied; several interleaved chunks
or a tied embedding's pipeline copies are rejected with a ConfigError (its hooks handle one model chunk,
whose gather units it names: `ShardableModel.zero3_units()`).

What it reads from the model: every parameter's `ParamSpec` (which pieces are TP-replicated, SP-partial
or a tied embedding's pipeline copy; building fails, naming the parameter, when one has none), the
ZeRO-3 units, and the linears that accept a weight-gradient fold (`FoldsWeightGrad`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.nn as nn

from megalite.errors import CheckpointError, ConfigError
from megalite.optim import zero_state
from megalite.optim.grads import GRAD_GROUP, GradSyncSwitch, unique_params
from megalite.optim.overlap import EventSink, OverlapEvent, OverlapSettings, ParamGatherOverlap
from megalite.optim.protocol import FoldsWeightGrad, ShardableModel
from megalite.optim.zero3 import Zero3Gatherer, stage3_units
from megalite.optim.zero_buckets import Bucket, adamw_flat, make_bucket, split_by_size
from megalite.parallel import comm
from megalite.parallel.param_spec import spec_table
from megalite.parallel.state import ParallelState


class ZeroOptimizer(GradSyncSwitch):
    """AdamW sharded over the data-parallel group at ZeRO `stage` 0-3, params kept in `dtype`."""

    def __init__(self, model: nn.Module, state: ParallelState, stage: int, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, dtype: torch.dtype = torch.float32,
                 settings: OverlapSettings = OverlapSettings(), on_event: EventSink | None = None) -> None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero={stage} is not a ZeRO stage: use 0, 1, 2 or 3")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"train.dtype {dtype} unsupported: use fp32, bf16 or fp16")
        if stage > 0 and state.size(GRAD_GROUP) == 1:
            warnings.warn(f"parallel.zero={stage} with dp=1 has nothing to shard: using zero=0 "
                          "(plain data parallel). Set parallel.zero=0 to silence this.", stacklevel=2)
            stage = 0
        self.model, self.state, self.stage, self.dtype = model, state, stage, dtype
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.step_count = 0
        self.settings, self._on_event = settings, on_event
        self._sync = True
        self._callback_queued = False
        self.specs = spec_table(model, ConfigError)
        params = unique_params(model)
        shared = [p for p in params if self.specs[p].pipeline_tied] if state.pp > 1 else []
        if stage == 3 and not isinstance(model, ShardableModel):
            # The gather/free hooks sit on one model chunk; several interleaved chunks are not handled.
            raise ConfigError("parallel.zero=3 with several model chunks per rank (parallel.vpp > 1) is not "
                              "supported yet: use parallel.zero<=2 with the interleaved schedule, or vpp=1")
        if stage == 3 and state.size("ep") > 1:
            raise ConfigError("parallel.zero=3 with parallel.ep > 1 is not supported yet: use parallel.zero<=2")
        if stage == 3 and shared:
            raise ConfigError("parallel.zero=3 with pp > 1 and tied embeddings is not supported yet: set "
                              "model.tie_embeddings=false or use parallel.zero<=2")
        self._names = {id(p): n for n, p in reversed(list(model.named_parameters()))}
        units: list[tuple[nn.Module, list[nn.Parameter]]] = []
        if isinstance(model, ShardableModel) and stage == 3:
            groups, outer = stage3_units(model, model.zero3_units(), params)
            units = groups
        else:
            # Reverse registration order ~ the order gradients become ready in backward.
            # A tied embedding's two pipeline copies each get a bucket of their own, so both stages
            # shard them identically and their reduced grads can be summed over the embedding group.
            rest = [p for p in params if all(p is not q for q in shared)]
            # Buckets never mix gradient groups (ParamSpec.grad_group: MoE experts reduce over "edp").
            kinds = list(dict.fromkeys(self.specs[p].grad_group for p in rest[::-1]))
            groups_p = [[p] for p in shared] + [g for kind in kinds for g in split_by_size(
                [p for p in rest[::-1] if self.specs[p].grad_group == kind], settings.bucket_bytes,
                settings.first_bucket_bytes)]
            units = [(model, g) for g in groups_p]
            outer = None
        self.buckets: list[Bucket] = [self._build_bucket(g) for _, g in ([outer] if outer else []) + units]
        self._shared_buckets = self.buckets[:len(shared)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._position = {id(b): i for i, b in enumerate(self.buckets)}
        self.zero3: Zero3Gatherer | None = None
        if stage == 3:
            it = iter(self.buckets)
            outer_pair = (outer[0], next(it)) if outer else None
            self.zero3 = Zero3Gatherer([(m, next(it)) for m, _ in units], outer_pair, state,
                                       self._queue_end_of_backward, settings.zero3_prefetch)
        self._param_sync = (ParamGatherOverlap(model, self.buckets, state, settings.param_gather, on_event)
                            if stage in (1, 2) else None)
        folded = self._register_folds(model)
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
                m.set_wgrad_fold(functools.partial(self._fold, m.weight))
                folded.add(id(m.weight))
        return folded

    def _build_bucket(self, params: list[nn.Parameter]) -> Bucket:
        st = self.state
        group = self.specs[params[0]].grad_group
        b, full32 = make_bucket(params, self.specs, st.size(group), st.rank_in(group), pad=self.stage > 0,
                                group=group)
        b.param_flat = full32.to(self.dtype)
        for p, off in zip(params, b.offsets):
            p.data = b.param_flat[off:off + p.numel()].view(p.shape)
        own = b.param_flat[b.lo:b.hi]
        if self.stage == 3:
            b.param_shard = own.clone()
            own = b.param_shard
        # fp32: the params are their own master weights (no copy); else an fp32 master shard.
        b.master = own if self.dtype == torch.float32 else full32[b.lo:b.hi].clone()
        b.exp_avg = torch.zeros(b.shard_numel, dtype=torch.float32, device=st.device)
        b.exp_avg_sq = torch.zeros_like(b.exp_avg)
        if self.stage <= 1:  # a persistent fp32 main-grad buffer
            b.grad_flat = torch.zeros(b.padded, dtype=torch.float32, device=st.device)
            b.grad_shard = b.grad_flat[b.lo:b.hi]
        else:
            b.grad_shard = torch.zeros(b.shard_numel, dtype=torch.float32, device=st.device)
        return b

    # ------------------------------------------------------------ backward hooks
    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for b in self.buckets:
            b.ready = 0
        if self.zero3 is not None:
            self.zero3.end_of_backward()

    def _on_grad(self, p: torch.Tensor) -> None:
        """A fresh `.grad` (post-accumulate hook): add it to the fp32 main grad and drop it."""
        grad = p.grad
        assert grad is not None
        p.grad = None
        self._fold(p, lambda main: main.add_(grad))

    def _check_folded(self, p: torch.Tensor) -> None:
        """A folded weight never gets a `.grad`: one here means a code path skipped the fold (and the
        gradient would be lost), so fail loudly."""
        if p.grad is not None:
            raise RuntimeError(f"{self._names.get(id(p), 'a parameter')}: got a .grad although its linear "
                               "adds the weight gradient to the optimizer's buffer (layers.linear_fn)")

    def _fold(self, p: torch.Tensor, accumulate: Callable[[torch.Tensor], None]) -> None:
        """`accumulate` adds this backward's gradient of `p` into the fp32 main-grad view it is given;
        then start the bucket's reduction if that was its last missing gradient."""
        b = self._bucket_of[id(p)]
        self._queue_end_of_backward()
        if b.grad_flat is None:
            b.grad_flat = torch.zeros(b.padded, dtype=torch.float32, device=self.state.device)
        off = b.offsets[b.index[id(p)]]
        accumulate(b.grad_flat[off:off + p.numel()].view(p.shape))
        b.ready += 1
        if b.ready == b.n_grads:
            b.ready = 0
            if self.zero3 is not None:
                self.zero3.free(b)
            if self._sync:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        """Start this bucket's DP reduction (all-reduce at stage 0, reduce-scatter otherwise)."""
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

    # ------------------------------------------------------------ the optimizer interface
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
        """Wait for every bucket's reduction (starting any that never filled), average over dp, then
        sum the SP-partial pieces over TP (DP average and TP sum commute: both are linear)."""
        n = self.state.size(GRAD_GROUP)
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
            # The average over dp x cp for every bucket, an "edp" one too: each of the dp x cp ranks' losses
            # contributed to an expert's gradient (through the all-to-all), summed over ep in the backward
            # and over edp here, so the global-token mean divides by dp x cp like the dense gradients.
            if n > 1:  # (a full pass over the gradients: skip it when alone)
                b.grad_shard.div_(n)
            if self.stage >= 2:
                b.grad_flat = None  # ZeRO-2: only the reduced shard is kept
        for b in self._shared_buckets:  # Megatron's tied-embedding sync (first and last stage)
            comm.all_reduce(b.grad_shard, self.state, "embedding")  # type: ignore[arg-type]
        if self.state.tp > 1:
            pieces = [(b, s) for b in self.buckets for s in b.segments if s.sp_partial]
            if pieces:
                flat = torch.cat([b.grad_shard[s.lo:s.hi] for b, s in pieces])  # type: ignore[index]
                comm.all_reduce(flat, self.state, "tp")
                off = 0
                for b, s in pieces:
                    b.grad_shard[s.lo:s.hi].copy_(flat[off:off + s.hi - s.lo])  # type: ignore[index]
                    off += s.hi - s.lo

    def scale_grads(self, factor: float) -> None:
        for b in self.buckets:
            b.grad_shard.mul_(factor)  # type: ignore[union-attr]

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient, each parameter once: TP-replicated pieces on tp rank
        0 only, summed over tp x pp ranks, and for stages >= 1 over the dp shards too."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.state.device)
        for kind in dict.fromkeys(b.group for b in self.buckets):
            pieces = [b.grad_shard[s.lo:s.hi] for b in self.buckets if b.group == kind  # type: ignore[index]
                      for s in b.segments if not ((s.replicated and self.state.tp_rank != 0) or s.copy)]
            # One fused fp32 norm per piece (no float64 copy of the gradients), their squares summed in float64.
            norms = torch._foreach_norm(pieces) if pieces else []
            part = (torch.stack(norms).double().pow(2).sum().reshape(1) if norms
                    else torch.zeros(1, dtype=torch.float64, device=self.state.device))
            if kind == "edp" and self.stage == 0:  # each ep rank holds other experts (edp x ep = dp x cp)
                comm.all_reduce(part, self.state, "ep", count_as="norm")
            sq += part
        if self.stage >= 1:  # every group's shards together cover dp x cp (edp x ep for the experts)
            comm.all_reduce(sq, self.state, GRAD_GROUP, count_as="norm")
        comm.all_reduce(sq, self.state, "mp")
        return math.sqrt(sq.item())

    def step(self, lr: float, clip: float, norm: float) -> None:
        """Clip by the global norm, AdamW on this rank's shard, then publish the new params (ZeRO-1/2:
        their all-gathers are launched, and waited on in the next forward unless the overlap is off)."""
        self.finish_param_sync()
        if clip > 0 and math.isfinite(norm) and norm > clip:
            scale = clip / (norm + 1e-6)  # the same factor as `grads.clip_gradients`
            for b in self.buckets:
                b.grad_shard.mul_(scale)  # type: ignore[union-attr]
        self.step_count += 1
        for b in self.buckets:
            adamw_flat(b, lr, self.weight_decay, self.betas, self.eps, self.step_count)
        self._publish_params(wait=False)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers still in flight (ZeRO-1/2 overlaps them with the next
        forward); call before reading the parameters outside a forward."""
        if self._param_sync is not None:
            self._param_sync.finish()

    @torch.no_grad()
    def _publish_params(self, wait: bool = True) -> None:
        """Copy the master shard into the model params (cast), and all-gather them at stages 1-2."""
        self.finish_param_sync()
        for b in self.buckets:
            own = b.param_shard if self.stage == 3 else b.param_flat[b.lo:b.hi]
            if own is not b.master and own.data_ptr() != b.master.data_ptr():
                own.copy_(b.master)
        if self._param_sync is not None:
            self._param_sync.launch()
            if wait:
                self._param_sync.finish()

    # ------------------------------------------------------------ checkpoints and accounting
    def state_dict(self) -> dict:
        """Everything this rank needs to resume the same layout: its master and Adam shards, the step."""
        self.finish_param_sync()  # fp32: the master shard is a view of the (being gathered) params
        return {"stage": self.stage, "dp": self.state.size(GRAD_GROUP), "step": self.step_count,
                "buckets": [{"numel": b.numel, "lo": b.lo, "hi": b.hi, "master": b.master.clone(),
                             "exp_avg": b.exp_avg.clone(), "exp_avg_sq": b.exp_avg_sq.clone()}
                            for b in self.buckets]}

    def load_state_dict(self, d: dict) -> None:
        mine = [(b.numel, b.lo, b.hi) for b in self.buckets]
        theirs = [(x["numel"], x["lo"], x["hi"]) for x in d.get("buckets", [])]
        n = self.state.size(GRAD_GROUP)
        if d.get("stage") != self.stage or d.get("dp") != n or mine != theirs:
            raise CheckpointError(f"optimizer state is for zero={d.get('stage')} dp={d.get('dp')} with another "
                                  f"bucket layout, this run is zero={self.stage} dp={n}: resume with "
                                  "the same parallel layout and ZeRO stage (or reshard the checkpoint)")
        self.finish_param_sync()  # nothing may still be writing the parameters we overwrite
        self.step_count = int(d["step"])
        with torch.no_grad():
            for b, x in zip(self.buckets, d["buckets"]):
                b.master.copy_(x["master"])
                b.exp_avg.copy_(x["exp_avg"])
                b.exp_avg_sq.copy_(x["exp_avg_sq"])
        self._publish_params()

    def param_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Checkpoint protocol: global name -> {"master", "exp_avg", "exp_avg_sq", "step"} (see zero_state)."""
        self.finish_param_sync()
        return zero_state.param_states(self.buckets, self._names, self.stage > 0, self.step_count, self.state)

    def load_param_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.finish_param_sync()
        self.step_count = zero_state.load_param_states(self.buckets, self._names, states)
        self._publish_params()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every parameter whole and current (stage 3 gathers every unit, stages 1-2 wait for their
        pending gathers), e.g. while a checkpoint is loaded into them or a sample is generated."""
        self.finish_param_sync()
        if self.zero3 is None:
            yield
            return
        units = ([self.zero3.outer[1]] if self.zero3.outer else []) + [b for _, b in self.zero3.blocks]
        for b in units:
            self.zero3.gather(b)
        try:
            yield
        finally:
            self.zero3.free_all()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered over dp (still TP-sharded), by name; for tests and checkpoints."""
        self.finish_param_sync()
        return zero_state.full_parameters(self.buckets, self._names, self.zero3 is not None, self.state)

    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds now, by kind (from the tensors; see the table in the module doc)."""
        out = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
        for b in self.buckets:
            out["params"] += b.param_flat.untyped_storage().nbytes()  # 0 while a stage-3 unit is freed
            if b.param_shard is not None:
                out["params"] += b.param_shard.numel() * b.param_shard.element_size()
            if b.grad_flat is not None:
                out["grads"] += b.grad_flat.numel() * 4
            if self.stage >= 2:  # its own tensor; at stages 0-1 it is a view of grad_flat
                out["grads"] += b.grad_shard.numel() * 4  # type: ignore[union-attr]
            if self.dtype != torch.float32:
                out["master"] += b.master.numel() * 4
            out["optimizer"] += (b.exp_avg.numel() + b.exp_avg_sq.numel()) * 4
        return out
