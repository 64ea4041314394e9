"""The peak memory of one rank, term by term: what `tools/estimate.py`, `tools/plan.py` and the check before step 1
predict, and what `bench/memory_peak.py` holds against the measured peak (docs/estimator.md#peak-memory).

The estimator's `Memory` (model states by ZeRO stage + Korthikanti et al.'s activations) is a floor: it leaves
out everything that lives only for part of a step. This model adds those parts, each a named `Term` with its
formula, at the moment of the step where they coincide:

    peak = baseline + model states + max(loss phase, backward phase, step phase) + allocator slack

  baseline        the interpreter, torch and megalite's pages (CPU; + torch._dynamo's wherever recompute runs
                  torch.utils.checkpoint, which imports it) or the CUDA context (GPU)

  model states    parameters, gradients, master weights, optimizer states by ZeRO stage (a MoE model's experts
                  over ep, their states over edp), ZeRO-3's fixed gather buffers, gloo's staging (CPU, ZeRO >= 1)
  loss phase      the activations in flight, the last micro-batch's logits and the cross-entropy's fp32 buffers,
                  ZeRO-2/3's full gradient buckets (held while micro-batches accumulate)
  backward phase  the activations in flight, the full gradient buckets and the reduce-scatters' outputs, one
                  layer's activation gradients, the recomputed block (full recompute), the cp ring's block-pair
                  scores (torch path), the zero-bubble schedules' deferred weight gradients
  step phase      the optimizer's temporary (0 for the fused AdamW; Muon's copies of its update direction)

Activations are megalite's own saved tensors (fused attention keeps no s x s scores: SDPA on CPU, flash on GPU),
not the paper's unfused GPT-3 layer. Plain Python (no torch), like the rest of `megalite.perfmodel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megalite.errors import ConfigError
from megalite.perfmodel.estimate import Memory, stage_params, zero_memory
from megalite.perfmodel.inputs import Layout, ModelDims, Precision
from megalite.perfmodel.mixers import stage_layers
from megalite.perfmodel.muon import muon_step_bytes
from megalite.perfmodel.saved_bytes import layer_activation_bytes, moe_layer_extra_bytes, uses_torch_checkpoint
from megalite.perfmodel.schedules import microbatches_in_flight

MiB = 2**20
# The interpreter, torch and megalite imported (262 MiB RSS: torch 2.13's CPU wheel, measured in a rank process
# before `main`, torch.fx's symbolic shapes included: megalite/pipeline/engine.py imports them up front) plus the
# code and data pages its first forward, backward and optimizer step fault in (43 MiB: the intercept of the smallest
# bench/memory_peak.py cases, their RSS minus their predicted tensors). Both depend on the torch build and the
# machine; `PeakOptions.baseline_bytes` overrides them.
CPU_IMPORTS_BYTES = 262 * MiB
CPU_KERNEL_PAGES_BYTES = 43 * MiB
# Recompute (selective or full) runs through torch.utils.checkpoint, and its first call imports torch._dynamo: in
# torch 2.13 `checkpoint` is wrapped by `torch._disable_dynamo` (torch/_compile.py: it imports torch._dynamo at the
# wrapped function's first call) and the non-reentrant frame reads `torch._dynamo.config` and builds its recompute
# hooks under `torch._dynamo.disable` (torch/utils/checkpoint.py). Dynamo's modules (torch.fx, sympy, the guards'
# C++ code) stay resident for the rest of the process. Measured with torch 2.13's CPU wheel (bench/memory_peak.py's
# `mid`, 2026-12-02): `import torch._dynamo` adds 142 MiB of RSS right after megalite's imports (67 MiB file-backed
# code pages, 76 MiB anonymous), and 106 MiB to the VmHWM of the same run without recompute (596.6 -> 703.1 MiB;
# the step touches part of those pages anyway); with full recompute importing it first changes the peak by 5 MiB
# (647.6 -> 652.4): that import is the whole of the ~100 MiB the full-recompute case measured above its model.
# Host memory only: not in the CUDA allocator's figures. (`model.compile` imports dynamo too, and inductor: not
# counted here.)
CPU_CHECKPOINT_IMPORTS_BYTES = 106 * MiB
# A CUDA context with torch's kernels loaded lazily (CUDA 12, H100/H200: ~500 MiB of device memory); outside
# torch's allocator, so not in torch.cuda.max_memory_allocated/reserved, but it is taken from the device's memory.
CUDA_CONTEXT_BYTES = 500 * MiB
# Allocator slack, as a share of the bytes that come and go within a step: glibc's heap on CPU (freed blocks
# that the next request does not fit, posix_memalign's slack; megalite.runtime.malloc), the CUDA caching
# allocator's rounding and split blocks on GPU (torch.cuda.max_memory_reserved over max_memory_allocated).
CPU_SLACK = 0.05
CUDA_SLACK = 0.10


@dataclass(frozen=True)
class Term:
    """One named part of the peak: its bytes, the formula they come from, and why it is held."""

    name: str
    bytes: float
    formula: str
    why: str


@dataclass(frozen=True)
class PeakOptions:
    """What the peak depends on beyond the model, layout and bytes per element.

    `optimizer_state_bytes`: bytes per parameter of optimizer state before ZeRO sharding (None: `prec.optimizer`,
    8 for Adam's two fp32 moments; an optimizer with one moment, Muon's momentum, passes 4).
    `optimizer_temp_bytes`: bytes the optimizer's `step` allocates and frees (0 for torch's fused AdamW, which
    updates in place; Newton-Schulz iterations would pass a few copies of the largest matrix).
    `baseline_bytes`: what the process holds before any model (None: the device's default above)."""

    device: str = "cpu"  # cpu | cuda
    baseline_bytes: float | None = None
    optimizer_state_bytes: float | None = None
    optimizer_temp_bytes: float = 0.0
    zero3_prefetch: int = 1
    bucket_bytes: float = 25 * MiB  # parallel.bucket_mb: the gradient buckets' fp32 bytes (the default's)
    torch_ring: bool = True  # cp > 1: the ring's block pairs in torch math (scores materialised), not Triton
    slack: float | None = None  # None: the device's default above
    fp8: tuple[str, int] | None = None  # (recipe, min_dim) of fp8.recipe / fp8.min_dim; None: no FP8

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"peak memory device {self.device!r} is unknown; use cpu or cuda")
        for name in ("baseline_bytes", "optimizer_state_bytes", "optimizer_temp_bytes", "slack"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name}={value} must be >= 0")


@dataclass(frozen=True)
class PeakMemory:
    """A rank's predicted peak (the worst pipeline stage): the terms that add up to `total`."""

    baseline: Term
    states: tuple[Term, ...]
    phases: dict[str, tuple[Term, ...]]
    slack: Term
    pp_rank: int = 0
    device: str = "cpu"
    peak_phase: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_phase", max(self.phases, key=lambda p: _sum(self.phases[p])))

    @property
    def model_states(self) -> float:
        return _sum(self.states)

    @property
    def transient(self) -> float:
        return _sum(self.phases[self.peak_phase])

    @property
    def total(self) -> float:
        return self.baseline.bytes + self.model_states + self.transient + self.slack.bytes

    @property
    def allocated(self) -> float:
        """What torch's allocator hands out at the peak (torch.cuda.max_memory_allocated's prediction)."""
        return self.model_states + self.transient

    @property
    def reserved(self) -> float:
        """torch.cuda.max_memory_reserved's prediction: allocated plus the caching allocator's slack."""
        return self.allocated + self.slack.bytes

    def terms(self) -> list[Term]:
        """Every term counted in `total`, largest phase's terms in place of the others."""
        return [self.baseline, *self.states, *self.phases[self.peak_phase], self.slack]

    def summary(self, top: int = 4) -> str:
        """`4.1 GiB = baseline 0.4 + optimizer states 1.6 + activations 1.2 + ...` (the largest `top` terms)."""
        ranked = sorted((t for t in self.terms() if t.bytes > 0), key=lambda t: -t.bytes)
        parts = [f"{t.name} {t.bytes / 2**30:.2f}" for t in ranked[:top]]
        rest = sum(t.bytes for t in ranked[top:])
        if rest:
            parts.append(f"{len(ranked) - top} more {rest / 2**30:.2f}")
        return f"{self.total / 2**30:.2f} GiB = " + " + ".join(parts) + f" (peak in the {self.peak_phase} phase)"

    def to_dict(self) -> dict:
        return {"total": self.total, "allocated": self.allocated, "reserved": self.reserved,
                "peak_phase": self.peak_phase, "pp_rank": self.pp_rank, "device": self.device,
                "terms": {t.name: t.bytes for t in self.terms()},
                "phases": {p: {t.name: t.bytes for t in ts} for p, ts in self.phases.items()}}


def _sum(terms: tuple[Term, ...]) -> float:
    return sum(t.bytes for t in terms)


def stage_peak(dims: ModelDims, layout: Layout, prec: Precision, pp_rank: int,
               opts: PeakOptions = PeakOptions()) -> PeakMemory:
    """The peak of one pipeline stage's rank (see the module doc for the phases)."""
    m = layout.num_microbatches
    p, t = layout.pp, layout.tp
    first, last = pp_rank == 0, pp_rank == p - 1
    e, g4 = prec.activation, 4.0
    tokens = layout.micro_batch_size * layout.local_seq_len(dims.seq_len)
    h = dims.hidden_size
    hs = h / t if layout.sp else h
    here = stage_layers(dims, p, pp_rank, layout.vpp, layout.schedule == "zbv")
    layers, linear = len(here), sum(i in dims.linear_layers for i in here)
    sp_rank = stage_params(dims, t, p, pp_rank, layout.ep, layout.vpp)
    psi = float(sp_rank.total)
    opt_prec = prec if opts.optimizer_state_bytes is None else replace(prec, optimizer=int(opts.optimizer_state_bytes))
    n = layout.replicas
    # The routed experts' states shard over edp = dp·cp/ep (the ranks holding the same experts), the rest over dp·cp.
    dense = zero_memory(psi - sp_rank.experts, n, layout.zero, opt_prec)
    expert = zero_memory(float(sp_rank.experts), n // layout.ep, layout.zero, opt_prec)
    st = Memory(*(getattr(dense, k) + getattr(expert, k) for k in ("params", "grads", "master", "optimizer")))
    zs = f"/{n}" if n > 1 else ""
    states: tuple[Term, ...] = (
        Term("parameters", st.params, f"{prec.param} B x {psi:.0f} params" + (zs if layout.zero >= 3 else ""),
             "the model's weights in the run dtype (ZeRO-3: this rank's shard)"),
        Term("gradients", st.grads, f"{prec.grad} B x params" + (zs if layout.zero >= 2 else ""),
             "fp32 main grads (ZeRO-2/3: the reduced shard; the full buckets are a backward-phase term)"),
        Term("master weights", st.master, f"{prec.master} B x params" + (zs if layout.zero >= 1 else ""),
             "fp32 copy the optimizer updates (none when the weights are fp32)"),
        Term("optimizer states", st.optimizer, f"{opt_prec.optimizer} B x params" + (zs if layout.zero >= 1 else ""),
             "the optimizer's per-parameter state (AdamW: two fp32 moments)"),
    )
    per_layer = layer_activation_bytes(dims, layout, prec, opts.fp8)
    per_linear = layer_activation_bytes(dims, layout, prec, opts.fp8, linear=True)
    in_flight = microbatches_in_flight(layout, pp_rank, m)
    moe_here = 0 if dims.moe is None else sum(i in dims.moe.layers for i in here)
    acts = ((per_layer * (layers - linear) + per_linear * linear + moe_layer_extra_bytes(dims, layout, prec) * moe_here)
            * in_flight + (2 * tokens * h * e * in_flight if last else 0.0))
    how = (f"{per_layer / MiB:.1f} MiB/layer x {layers - linear} layers"
           + (f" + {per_linear / MiB:.1f} MiB/linear layer x {linear}" if linear else "")
           + f" x {in_flight:g} micro-batches in flight"
           + (" + final norm in/out 2·b·s·h" if last else ""))
    activations = Term("activations", acts, how,
                       f"saved for the backward ({layout.schedule} holds {in_flight:g} on stage {pp_rank})"
                       if p > 1 else "saved for the backward (one micro-batch at a time)")
    vocab = dims.padded_vocab(t) / t
    logits_elems = tokens * vocab
    # fp32 run: the logits are the fp32 z itself; 16-bit: the logits plus their fp32 copy. Then z - max, exp,
    # softmax: the cross-entropy's forward holds four fp32 [b·s, V/t] buffers at once (megalite/layers/cross_entropy).
    ce_fwd = logits_elems * ((e if e != 4 else 0) + 4 * g4) if last else 0.0
    logits = Term("logits and cross-entropy", ce_fwd, f"b·s·V/t x ({'' if e == 4 else f'{e} + '}4 x 4 B), "
                  f"V/t = {vocab:.0f}", "logits, z - max, exp and softmax alive together in the loss's forward")
    ce_bwd = Term("cross-entropy gradient", 2 * logits_elems * g4 if last else 0.0, "b·s·V/t x 2 x 4 B",
                  "the saved softmax turned into the logits' gradient, and its scaled copy")
    grads_full = psi * 4.0
    buckets = grads_full if layout.zero >= 2 else 0.0
    bucket_hold = Term("gradient buckets", buckets, "4 B x params (full fp32 buckets)" if buckets else "0",
                       "ZeRO-2/3 build each bucket's full fp32 gradient on its first gradient and free it after the "
                       "step's reduce-scatter (micro-batches accumulate into it)")
    scatter = grads_full / n if layout.zero >= 1 and n > 1 else 0.0
    reduction = Term("in-flight reduction", scatter, "4 B x params / N" if scatter else "0",
                     "every bucket's reduce-scatter output, from its launch in the backward to the step's sync")
    # gloo runs collectives on its two worker threads, and the parameter all-gathers (ZeRO >= 1: the updated
    # shards after the step, ZeRO-3's gathers) stage a bucket each in the thread's own malloc arena, which keeps
    # it: measured with a malloc trace, 49-52 MiB outside the main heap at dp 2 (docs/estimator.md). NCCL: none.
    staging = 0.0
    if opts.device == "cpu" and layout.zero >= 1 and n > 1:
        staging = min(psi, 2 * opts.bucket_bytes / 4) * prec.param
    gloo = Term("gloo staging", staging, f"min(params, 2 buckets of {opts.bucket_bytes / MiB:g} MiB fp32) x "
                f"{prec.param} B" if staging else "0", "the parameter all-gathers' copies in gloo's two worker "
                "threads' malloc arenas, resident from the first step's")
    unit, outer = float(sp_rank.largest_layer), psi - sp_rank.layers
    gathered = ((1 + opts.zero3_prefetch) * unit + outer) * prec.param if layout.zero >= 3 and n > 1 else 0.0
    zero3 = Term("ZeRO-3 gather buffers", gathered, f"((1 + prefetch {opts.zero3_prefetch}) x {unit:.0f} + "
                 f"{outer:.0f} outer) params x {prec.param} B" if gathered else "0",
                 "fixed buffers the gathers reuse (megalite/dp/zero3.py): the block computing, the ones prefetched "
                 "and the outer unit (embedding, head, final norm), whole; held from the first step on")
    unrecomputed = replace(layout, recompute="none")
    one_layer = max(layer_activation_bytes(dims, unrecomputed, prec, opts.fp8, linear=kind) for kind in
                    {i in dims.linear_layers for i in here}) + (
        moe_layer_extra_bytes(dims, unrecomputed, prec) if moe_here else 0.0)  # the largest block's
    layer_grads = Term("layer gradients", one_layer,
                       "one layer's saved bytes again", "each saved tensor's gradient while its layer runs backward")
    recompute = Term("recomputed block", one_layer if layout.recompute == "full" else 0.0,
                     "one layer's saved bytes (full recompute)",
                     "full recompute re-runs a block's forward right before its backward")
    scores = 0.0
    if layout.cp > 1 and opts.torch_ring and layout.cp_mode in ("ring", "allgather"):
        s_local = layout.local_seq_len(dims.seq_len)
        scores = 3.0 * layout.micro_batch_size * dims.num_heads / t * s_local * s_local * g4
    ring = Term("cp block-pair scores", scores, "3 x b·a/t·(S/cp)² x 4 B" if scores else "0",
                "the torch block math's scores, probabilities and their gradient for one block pair")
    masked = 0.0
    if layout.document_mask and layout.cp == 1:  # SDPA under an explicit mask: the math kernel (megalite/model/ops)
        masked = 3.0 * layout.micro_batch_size * dims.num_heads / t * float(dims.seq_len) ** 2 * g4
    mask = Term("masked attention scores", masked, "3 x b·a/t·S² x 4 B" if masked else "0",
                "document masking runs SDPA with a mask: one layer's scores, probabilities and their gradient")
    deferred = 0.0
    if p > 1 and layout.schedule in ("zb-h1", "zbv"):
        # B ran, W not yet: each linear's output gradient waits for its weight gradient.
        out_grads = tokens * ((dims.num_heads + 2 * dims.kv_heads) * dims.hd / t + h
                              + ((2 if dims.arch == "llama" else 1) * dims.ffn / t) + h) * e
        deferred = out_grads * layers * max(1.0, in_flight - 1)
    zb = Term("deferred weight gradients", deferred, "linears' output grads x layers x (in flight - 1)"
              if deferred else "0", "zero-bubble schedules run W after B: its inputs wait")
    p2p = Term("pipeline buffers", 2 * tokens * hs * e * in_flight if p > 1 else 0.0,
               "2 x b·s·h (/t with SP) x in flight" if p > 1 else "0", "received activations and sent gradients")
    step = Term("optimizer temporary", opts.optimizer_temp_bytes, "an input (0: fused AdamW updates in place)",
                "what the optimizer's step allocates and frees")
    states += (zero3, gloo)
    phases = {"loss": (activations, logits, bucket_hold if m > 1 else replace(bucket_hold, bytes=0.0), p2p),
              "backward": (activations, ce_bwd, bucket_hold, reduction, layer_grads, recompute, ring, mask, zb, p2p),
              "step": (step,)}
    if opts.device == "cpu":
        dynamo = CPU_CHECKPOINT_IMPORTS_BYTES if uses_torch_checkpoint(layout) else 0.0
        base = (CPU_IMPORTS_BYTES + CPU_KERNEL_PAGES_BYTES + dynamo if opts.baseline_bytes is None
                else opts.baseline_bytes)
        baseline = Term("baseline", base, "interpreter + torch + megalite + first kernels' pages"
                        + (" + torch._dynamo (imported by torch.utils.checkpoint: recompute)" if dynamo else ""),
                        "code and data pages, resident whatever the tensors (dynamo's from the first checkpoint)")
        share = CPU_SLACK if opts.slack is None else opts.slack
    else:
        base = CUDA_CONTEXT_BYTES if opts.baseline_bytes is None else opts.baseline_bytes
        baseline = Term("CUDA context", base, "driver + kernels (lazy loading)", "outside torch's allocator")
        share = CUDA_SLACK if opts.slack is None else opts.slack
    peak = PeakMemory(baseline, states, phases, Term("allocator slack", 0.0, "", ""), pp_rank, opts.device)
    slack = Term("allocator slack", share * peak.transient, f"{share:.0%} x the peak phase's bytes",
                 "freed blocks the allocator keeps but cannot reuse for the next request")
    return replace(peak, slack=slack)


def peak_memory(dims: ModelDims, layout: Layout, prec: Precision, opts: PeakOptions = PeakOptions()) -> PeakMemory:
    """The worst pipeline stage's peak (the first and last: middle stages hold fewer micro-batches in flight, no
    embedding and no logits; `megalite.perfmodel.plan.worst_stage_memory`'s argument)."""
    layout = _as_estimated(layout)
    return max((stage_peak(dims, layout, prec, r, opts) for r in {0, layout.pp - 1}), key=lambda pk: pk.total)


def run_peak(dims: ModelDims, layout: Layout, prec: Precision, device: str = "cpu", optimizer: str = "adamw",
             fp8: tuple[str, int] | None = None, zero3_prefetch: int = 1, torch_ring: bool = True) -> PeakMemory:
    """The peak of a megalite run (the check before step 1's and `tools/estimate.py`'s, one call): the device's
    baseline, its optimizer's step temporary (Muon's copies of its update direction), its FP8 recipe, its ZeRO-3
    prefetch depth and the cp ring's block path."""
    temp = muon_step_bytes(dims, layout) if optimizer == "muon" else 0.0
    return peak_memory(dims, layout, prec, PeakOptions(device=device, optimizer_temp_bytes=temp, fp8=fp8,
                                                       zero3_prefetch=zero3_prefetch, torch_ring=torch_ring))


def fits(peak_bytes: float, available: float, processes: int = 1) -> bool:
    """Whether `processes` processes that each peak at `peak_bytes` (`PeakMemory.total`) fit in `available` bytes:
    the one comparison behind the check before step 1 (processes sharing a host's RAM, or one per GPU) and
    tools/plan.py's fit filter (one per GPU, `available` = its usable memory)."""
    return peak_bytes * processes <= available


# What the planner sizes: a megalite run on a GPU (CUDA context, caching allocator, fused attention, the Triton ring
# blocks), the numbers the check before step 1 and `tools/estimate.py --memory-device cuda` give the same layout.
PLANNER_PEAK = PeakOptions(device="cuda", torch_ring=False)


def _as_estimated(layout: Layout) -> Layout:
    """The schedule and virtual stages `estimate` runs a layout with (ZB-V: two chunks; vpp > 1: interleaved)."""
    if layout.schedule == "zbv":
        return replace(layout, vpp=2)
    if layout.vpp > 1 and layout.schedule != "interleaved":
        return replace(layout, schedule="interleaved")
    return layout
