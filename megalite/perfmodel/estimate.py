"""The arithmetic of 3D parallelism and ZeRO as pure functions: parameters, memory, communication, time.

Everything here is plain Python (no torch) so `tools/estimate.py` and the planner run anywhere.
Units: bytes and seconds; "GB" means 1e9 bytes, as in the ZeRO paper.

Communication is counted in megalite's "wire bytes" (see `megalite.parallel.counter`): what one rank
sends under a ring algorithm. All-reduce of X bytes over N ranks: 2(N-1)/N·X; all-gather or
reduce-scatter of a full tensor of X bytes: (N-1)/N·X; a point-to-point send: X.

Where common rules of thumb are wrong this module follows the papers:
* ZeRO-3 moves 3Ψ(N-1)/N per micro-batch (two parameter all-gathers, forward and backward, plus
  one gradient reduce-scatter; Rajbhandari et al. 2020, section 7.2): with one micro-batch per
  step 1.5x DDP, not "the same as DDP" as often stated.
* 1F1B does not shrink the pipeline bubble; see `megalite.perfmodel.schedules.pipeline_bubble`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from megalite.errors import ConfigError
from megalite.model.params import ParamShape, count_params  # noqa: F401  (re-exported)
from megalite.mla import costs as mla_costs
from megalite.mtp.costs import mtp_flops_per_token, mtp_params
from megalite.perfmodel.inputs import PRESETS, Hardware, Layout, ModelDims, Precision  # noqa: F401  (re-exported)
from megalite.perfmodel.activations import activation_bytes_per_layer, stage_activation_bytes  # noqa: F401
from megalite.perfmodel.context import check_cp_mode, cp_comm_bytes, ring_exposed_seconds
from megalite.perfmodel.flops import attention_term, flops_per_token, hfu_ratio
from megalite.perfmodel.mixers import pipeline_imbalance, stage_layers
from megalite.perfmodel.fp8 import fp8_estimate
from megalite.perfmodel.stage_params import (StageParams, block_params, dims_params, layer_params,  # noqa: F401
                                             stage_params)  # (re-exported: their old home)
from megalite.perfmodel.schedules import (SCHEDULES, Schedule, bubble_overhead, microbatches_in_flight,  # noqa: F401
                                          pipeline_bubble, schedule)  # (re-exported: the public names)

GB = 1e9


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def zero_shard(psi: float, nd: int) -> float:
    """Elements per rank of a ZeRO-partitioned flat buffer: padded to a multiple of Nd for integer
    counts (what a flat-buffer implementation holds), exact division otherwise."""
    if float(psi).is_integer():
        return float(-(-int(psi) // nd))
    return psi / nd


def zero_memory(psi: float, nd: int, stage: int, prec: Precision = Precision()) -> Memory:
    """Model-state bytes per device for Ψ parameters on this rank, ZeRO `stage` over Nd ranks
    (Rajbhandari et al. 2020, figure 1). With K = master + optimizer bytes (12 for mixed Adam):
    DDP (2+2+K)Ψ; stage 1: 4Ψ + KΨ/Nd; stage 2: 2Ψ + (2+K)Ψ/Nd; stage 3: (2+2+K)Ψ/Nd.
    The general bytes (`prec`) make fp32 training (4, 4, 0, 8) exact too."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={stage} is invalid; use 0, 1, 2 or 3")
    shard = zero_shard(psi, nd)
    full = float(psi)
    return Memory(
        params=prec.param * (shard if stage >= 3 else full),
        grads=prec.grad * (shard if stage >= 2 else full),
        master=prec.master * (shard if stage >= 1 else full),
        optimizer=prec.optimizer * (shard if stage >= 1 else full),
    )


# ---------------------------------------------------------------- communication

def all_reduce_bytes(x: float, n: int) -> float:
    return 2.0 * (n - 1) / n * x if n > 1 else 0.0


def all_gather_bytes(x: float, n: int) -> float:
    """All-gather producing (or reduce-scatter consuming) a full tensor of x bytes."""
    return (n - 1) / n * x if n > 1 else 0.0


reduce_scatter_bytes = all_gather_bytes


def dp_comm_bytes(psi: float, nd: int, zero: int, prec: Precision = Precision(),
                  microbatches: int = 1) -> float:
    """Wire bytes per rank per step over the data-parallel group.

    DDP: one all-reduce of the gradients, 2Ψ(N-1)/N·bytes (ring all-reduce).
    ZeRO-1/2: reduce-scatter of gradients + all-gather of updated parameters: the same 2Ψ(N-1)/N.
    ZeRO-3: parameters all-gathered for the forward and again for the backward, gradients
    reduce-scattered: 3Ψ(N-1)/N per micro-batch (the full weights are never kept between uses);
    with `prec.zero3_reduce_once` (megalite) the gradients are reduce-scattered once per step.
    Flat ZeRO buffers are padded to a multiple of N (`zero_shard`)."""
    if nd <= 1:
        return 0.0
    grad_b, param_b = prec.reduce_bytes, prec.param
    if zero == 0:
        return all_reduce_bytes(psi * grad_b, nd)
    padded = zero_shard(psi, nd) * nd
    if zero in (1, 2):
        return all_gather_bytes(padded * (grad_b + param_b), nd)
    if prec.zero3_reduce_once:
        return all_gather_bytes(padded * (grad_b + 2 * microbatches * param_b), nd)
    return microbatches * all_gather_bytes(padded * (grad_b + 2 * param_b), nd)


def tp_comm_bytes(dims: ModelDims, layout: Layout, prec: Precision, pp_rank: int, m: int) -> float:
    """Wire bytes per rank per step over the tensor-parallel group (Shoeybi et al. 2019).

    Per layer and micro-batch, 4 all-reduces of b·s·h (2 forward at the attention and MLP exits,
    2 backward at their entries); under SP each is an all-gather + reduce-scatter of the same
    volume (Korthikanti et al. 2022). Full recompute repeats the forward ones but the MLP's last (1 all-reduce,
    or an all-gather, reduce-scatter and all-gather under SP; see the comment below). The first stage
    adds the vocab-parallel embedding's reduction, the last the head's input (one b·s·h each way)
    and the cross-entropy's 3 fp32 all-reduces of b·s. Under SP the grads of replicated, sequence-
    partial parameters (norms, gpt2 row biases and positions) are all-reduced once per step.
    Under context parallelism every activation term is for this rank's S/cp tokens; the partial
    gradients are parameter-sized (gpt2's learned positions stay S x h)."""
    t = layout.tp
    if t == 1:
        return 0.0
    bs = float(layout.micro_batch_size) * layout.local_seq_len(dims.seq_len)
    x = bs * dims.hidden_size * prec.activation
    # Full recompute re-runs a block's forward collectives except the last: torch's (non-reentrant)
    # checkpoint stops recomputing once every tensor the backward saved is back, and nothing saved depends on
    # the MLP's output reduction (its all-reduce, or SP's reduce-scatter: half an all-reduce's bytes).
    rerun = (1.5 if layout.sp else 1.0) if layout.recompute == "full" else 0.0
    per_layer = (4 + rerun) * all_reduce_bytes(x, t)
    total = m * len(stage_layers(dims, layout.pp, pp_rank, layout.vpp, layout.schedule == "zbv")) * per_layer
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    total += m * (first + last) * all_reduce_bytes(x, t)
    total += m * last * all_reduce_bytes(3 * bs * 4, t)
    partial: float = 0.0
    if layout.sp:
        partial = stage_params(dims, t, layout.pp, pp_rank, vpp=layout.vpp).tp_replicated_partial
    elif dims.mla is not None:  # MLA's replicated q_a / kv_a (and norms) have partial gradients at any tp
        whole = mla_costs.attention_weights(dims.hidden_size, dims.num_heads, dims.mla)[1]
        partial = dims.num_layers // layout.pp * (whole + dims.mla.q_lora_rank + dims.mla.kv_lora_rank)
    if partial:
        if layout.zero >= 1:
            # ZeRO >= 1 sums only the partial pieces inside this rank's 1/(dp·cp) gradient shard (exact
            # when the shard boundaries split them evenly, as for megalite's single-bucket small models).
            partial = partial / layout.replicas
        total += all_reduce_bytes(partial * prec.reduce_bytes, t)
    return total


def pp_comm_bytes(dims: ModelDims, layout: Layout, prec: Precision, pp_rank: int, m: int) -> float:
    """Bytes one rank sends point-to-point per step: per micro-batch, its activations b·s·h forward
    (unless it holds the last model chunk) and their gradient backward (unless the first). SP
    sends the sequence-sharded b·s·h/t. Interleaving sends v times, one per model chunk. Under context
    parallelism s is this rank's S/cp tokens."""
    p, v = layout.pp, layout.vpp
    if p == 1:
        return 0.0
    x = float(layout.micro_batch_size) * layout.local_seq_len(dims.seq_len) * dims.hidden_size * prec.activation
    if layout.sp:
        x /= layout.tp
    sends = 2 * m * v - m * (pp_rank == p - 1) - m * (pp_rank == 0)
    return sends * x


def embedding_comm_bytes(dims: ModelDims, layout: Layout, prec: Precision, pp_rank: int) -> float:
    """Tied embeddings split over pipeline stages (or the multi-token prediction modules' copy of the embedding
    on the last stage): the first and last stage all-reduce the shared shard's gradient over their 2-rank
    'embedding' group once per step."""
    if not (dims.tied or dims.mtp_layers) or layout.pp == 1 or pp_rank not in (0, layout.pp - 1):
        return 0.0
    return all_reduce_bytes(dims.padded_vocab(layout.tp) // layout.tp * dims.hidden_size
                            * prec.reduce_bytes, 2)


# ---------------------------------------------------------------- pipeline and time

@dataclass
class Estimate:
    """Everything `tools/estimate.py` reports. Per-device numbers are for the worst pp stage."""

    params: float
    params_per_device: float
    memory: Memory
    comm_bytes: dict[str, float]
    num_microbatches: int
    bubble: float
    model_flops_per_step: float | None = None
    hardware_flops_per_step: float | None = None
    comm_seconds: dict[str, float] = field(default_factory=dict)
    compute_seconds: float | None = None
    step_seconds: float | None = None
    step_seconds_overlapped: float | None = None
    predicted_mfu: float | None = None
    warnings: list[str] = field(default_factory=list)
    predicted_hfu: float | None = None  # hardware FLOPs (recompute counted) over the same time and peak
    cp_exposed_seconds: float | None = None  # the cp ring's transfers not hidden behind attention compute
    # Causal-halved attention count (`mfu_causal`), HFU = MFU x hfu_ratio (one count), FP8 (docs/fp8.md).
    model_flops_causal_per_step: float | None = None
    predicted_mfu_causal: float | None = None
    hfu_ratio: float = 1.0
    hfu_convention: str = "executed"
    fp8: dict | None = None
    predicted_mfu_fp8_peak: float | None = None  # the same model FLOPs over the FP8 dense peak, beside MFU

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"]["model_states"] = self.memory.model_states
        d["memory"]["total"] = self.memory.total
        return d


def estimate(dims: ModelDims | None, layout: Layout, prec: Precision = Precision(),
             params: float | None = None, hw: Hardware = Hardware(), fp8: tuple[str, int] | None = None,
             hfu_convention: str = "executed") -> Estimate:
    """Memory, communication, FLOPs, bubble and step time of one layout on `hw`.

    `params` overrides the count from `dims` (Ψ per device then = params/(tp·pp)); with `dims`
    None only model-state memory and DP traffic are computed (the classic DDP example). TP traffic uses
    `hw.intra_bytes_per_s` (NVLink), PP/DP/embedding traffic `hw.inter_bytes_per_s` (defaults to each other),
    the cp ring `hw.cp_bytes_per_s` (default: intra-node, where the rank order tp, cp, dp, pp puts it).
    `compute_seconds` is the hardware FLOPs at `efficiency` x peak, stretched by the bubble;
    `step_seconds` adds all traffic (no overlap), `step_seconds_overlapped` hides DP traffic
    behind compute and the cp ring's transfers behind attention compute, step by step of the ring
    (`cp_exposed_seconds`; TP and PP traffic sit on the critical path either way).
    `fp8` (recipe, min_dim): the filtered GEMMs run at `fp8_peak_flops` x efficiency and their amax
    all-reduces join the tp/cp traffic (megalite/perfmodel/fp8.py); MFU stays over the BF16 `peak_flops`."""
    peak_flops, efficiency, fp8_peak_flops = hw.peak_flops, hw.efficiency, hw.fp8_peak_flops
    inter_bytes_per_s, intra_bytes_per_s, cp_bytes_per_s = hw.inter_bytes_per_s, hw.intra_bytes_per_s, hw.cp_bytes_per_s
    m, p = layout.num_microbatches, layout.pp
    if layout.schedule == "zbv":  # two chunks per rank in a V, whatever vpp says (Qi et al. 2024)
        v = 2
    else:
        v = layout.vpp if layout.schedule == "interleaved" or layout.vpp > 1 else 1
    layout = replace(layout, vpp=v, schedule="interleaved" if v > 1 and layout.schedule != "zbv" else layout.schedule)
    sched = schedule(layout.schedule)
    for name, value in (("params", params), ("peak_flops", peak_flops), ("inter_bytes_per_s", inter_bytes_per_s),
                        ("intra_bytes_per_s", intra_bytes_per_s), ("cp_bytes_per_s", cp_bytes_per_s)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name}={value} must be > 0 (or left out)")
    if not 0 < efficiency <= 1:
        raise ConfigError(f"efficiency={efficiency} must be in (0, 1], e.g. 0.5 for half the peak")
    if layout.sp and layout.tp == 1:
        raise ConfigError("parallel.sp needs parallel.tp > 1; turn sp off or raise tp")
    if dims is not None and dims.num_layers % (p * v):
        raise ConfigError(f"num_layers {dims.num_layers} is not divisible by pp x vpp = {p * v}; "
                          f"change parallel.pp/parallel.vpp or model.num_layers")
    if params is None and dims is None:
        raise ConfigError("give model dimensions (a preset or --num-layers ...) or --params")
    if dims is not None:
        layout.local_seq_len(dims.seq_len)  # the zigzag split's 2·cp chunks: one clear error, up front
        check_cp_mode(dims, layout)
    warnings: list[str] = []
    if p > 1 and m < p:
        warnings.append(f"{m} micro-batches < pp={p}: stages idle {sched.bubble(p, m, v):.0%} of "
                        f"the step; raise train.global_batch_size to at least {p} micro-batches")
    if v > 1 and m % p and layout.schedule == "interleaved":
        warnings.append(f"interleaved schedule needs micro-batches ({m}) to be a multiple of pp={p}")
    total = float(params) if params is not None else float(dims_params(dims))  # type: ignore[arg-type]
    worst: tuple[Memory, float] | None = None
    comm: dict[str, float] = {}
    for r in range(p) if dims is not None else [0]:
        psi = (total / (layout.tp * p) if params is not None or dims is None
               else float(stage_params(dims, layout.tp, p, r, vpp=v).total))
        mem = zero_memory(psi, layout.replicas, layout.zero, prec)  # dp·cp ranks hold these parameters
        groups = {"dp": dp_comm_bytes(psi, layout.replicas, layout.zero, prec, m)}
        if dims is not None:
            mem = replace(mem, activations=stage_activation_bytes(dims, layout, prec, r, m))
            groups.update(tp=tp_comm_bytes(dims, layout, prec, r, m),
                          pp=pp_comm_bytes(dims, layout, prec, r, m),
                          embedding=embedding_comm_bytes(dims, layout, prec, r),
                          cp=cp_comm_bytes(dims, layout, prec, m, r))
        for g, nbytes in groups.items():
            comm[g] = max(comm.get(g, 0.0), nbytes)
        if worst is None or mem.total > worst[0].total:
            worst = (mem, psi)
    assert worst is not None
    comm = {g: nbytes for g, nbytes in comm.items() if nbytes > 0.0 or g == "dp"}
    est = Estimate(params=total, params_per_device=worst[1], memory=worst[0], comm_bytes=comm,
                   num_microbatches=m, bubble=sched.bubble(p, m, v) if p > 1 else 0.0,
                   warnings=warnings)
    inter = inter_bytes_per_s or intra_bytes_per_s
    intra = intra_bytes_per_s or inter_bytes_per_s
    ring = cp_bytes_per_s or intra
    if inter and intra and ring:
        speed = {"tp": intra, "cp": ring}
        est.comm_seconds = {g: nbytes / speed.get(g, inter) for g, nbytes in comm.items()}
    if dims is None:
        return est
    tokens = float(m) * layout.micro_batch_size * layout.dp * dims.seq_len
    model_per_token, hardware_per_token = flops_per_token(dims, total - mtp_params(dims.mtp_layers, dims.hidden_size,
                                                                                   block_params(dims)),
                                                          layout.recompute)
    mtp_flops = mtp_flops_per_token(dims.mtp_layers, dims.hidden_size, dims.vocab_size, block_params(dims),
                                    dims.num_heads * dims.hd, dims.seq_len)
    model_per_token, hardware_per_token = model_per_token + mtp_flops, hardware_per_token + mtp_flops
    est.model_flops_per_step = tokens * model_per_token
    est.hardware_flops_per_step = tokens * hardware_per_token  # what recompute repeats included
    # The causal-halved count (`mfu_causal`): each attention layer's term at the pairs it computes (`attention_keys`);
    # a linear layer's recurrence is counted as the chunked form computes it in both.
    halved = attention_term(dims) - attention_term(dims, causal=True)
    est.model_flops_causal_per_step = est.model_flops_per_step - tokens * 12.0 * halved
    est.hfu_ratio, est.hfu_convention = hfu_ratio(dims, layout.recompute, hfu_convention), hfu_convention
    fp8_fraction = 0.0
    if fp8 is not None:
        f8 = fp8_estimate(dims, layout, fp8[0], fp8[1], hardware_per_token, fp8_peak_flops)
        est.fp8, fp8_fraction = f8.to_dict(), f8.fp8_flops_fraction
        for g, nbytes in f8.amax_bytes.items():
            est.comm_bytes[g] = est.comm_bytes.get(g, 0.0) + nbytes
            if g in est.comm_seconds:
                est.comm_seconds[g] += nbytes / ({"tp": intra, "cp": ring}[g] or 1.0)
    if not peak_flops:
        return est
    fp8_speedup = (fp8_peak_flops / peak_flops) if fp8 is not None and fp8_peak_flops else 1.0
    ideal = est.hardware_flops_per_step * (1.0 - fp8_fraction + fp8_fraction / fp8_speedup) / layout.world \
        / (peak_flops * efficiency)
    # Layers of unequal cost (sliding windows, linear layers): the slowest stage sets the pace (mixers.pipeline_imbalance).
    est.compute_seconds = ideal * pipeline_imbalance(dims, layout.pp * layout.vpp) / (1.0 - est.bubble)
    if est.comm_seconds or not any(comm.values()):
        other = sum(sec for g, sec in est.comm_seconds.items() if g not in ("dp", "cp"))
        dp_s, cp_s = est.comm_seconds.get("dp", 0.0), est.comm_seconds.get("cp", 0.0)
        if "cp" in comm and ring:
            est.cp_exposed_seconds = ring_exposed_seconds(dims, layout, prec, m, peak_flops * efficiency, ring)
        est.step_seconds = est.compute_seconds + other + dp_s + cp_s
        est.step_seconds_overlapped = max(est.compute_seconds, dp_s) + other + (est.cp_exposed_seconds or 0.0)
        est.predicted_mfu = est.model_flops_per_step / layout.world / est.step_seconds / peak_flops
        est.predicted_hfu = est.predicted_mfu * est.hfu_ratio
        est.predicted_mfu_causal = est.model_flops_causal_per_step / layout.world / est.step_seconds / peak_flops
        if fp8 is not None and fp8_peak_flops:
            est.predicted_mfu_fp8_peak = est.predicted_mfu * peak_flops / fp8_peak_flops
    return est
