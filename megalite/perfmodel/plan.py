"""Pick a parallel layout for a model on a cluster: enumerate, drop what does not fit, rank by time.

The usual rules of thumb: tensor parallelism inside a node (its 4 all-reduces per
layer need NVLink), pipeline parallelism next (only point-to-point sends, but a bubble), data
parallelism as large as memory allows (its traffic overlaps the backward pass). This module turns
those rules into arithmetic: every (tp, cp, pp, dp, zero, vpp, micro-batch, recompute) that is legal is
costed with `megalite.perfmodel.estimate` (memory per device, bytes per group, step time), layouts that
exceed the memory limit are dropped, and the rest are ranked by predicted step time. The rules
then only break ties, i.e. they are followed exactly where the arithmetic agrees with them.

What is not enumerated, and why (each is dominated under the estimator's model, so it could only
tie or lose against a layout that is enumerated):
* sequence parallelism off when tp > 1: SP moves the same TP volume (all-gather + reduce-scatter
  instead of all-reduce; Korthikanti et al. 2022) and divides activations and pipeline sends by tp.
* the GPipe schedule: the same bubble as 1F1B with m instead of p micro-batches in flight.
* tp across nodes (tp must divide the GPUs per node) and m < pp (the "most common
  config error": stages idle most of the step).
* for one (tp, pp, vpp, micro-batch), a ZeRO stage or recompute level above the lowest one that
  fits: ZeRO-1/2 move the same DP bytes as DDP and ZeRO-3 more (Rajbhandari et al. 2020), and
  recompute only adds FLOPs and traffic. Only the Pareto front of (zero, recompute) is costed.
  (Under SP, ZeRO>=1 also shrinks the tiny TP sum of norm gradients by 1/dp: a < 0.1% effect,
  far inside TIE_TOLERANCE, where the rules would prefer the lower stage anyway.)

Context parallelism (cp) is opt-in, like the zero-bubble schedules: `cp_sizes` lists the sizes tried, and the
default (None) tries cp = 1 and, only when no layout fits, the powers of two that split the sequence into
2·cp chunks. A cp ring whose tp·cp ranks fit in a node (the rank order is tp, cp, dp, pp) runs at the
intra-node bandwidth, a larger one at the inter-node bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol

from megalite.errors import ConfigError
from megalite.perfmodel.estimate import GB, Estimate, Hardware, Layout, ModelDims, Precision, dims_params, estimate
from megalite.perfmodel.peak_memory import PLANNER_PEAK, PeakMemory, fits, peak_memory


class Explained(Protocol):
    """What a plan carries of a comparison the user asked for (`megalite.perfmodel.compare.Comparison`)."""

    explanation: str

    def to_dict(self) -> dict: ...


RECOMPUTE = ("none", "selective", "full")
# Step times within this of the fastest are a tie: the estimator (ideal peak, ring bandwidths) is
# not more accurate than ~1%, so among them the rules of thumb decide (see `rank`).
TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Cluster:
    """The hardware: `nodes` x `gpus_per_node` devices; bandwidths in bytes/s per device."""

    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: float
    intra_bytes_per_s: float  # NVLink-class, used for TP (and for everything on a single node)
    inter_bytes_per_s: float  # network, used for DP, PP and the tied-embedding group
    peak_flops: float  # dense peak per device in the training dtype
    memory_fraction: float = 0.9  # usable share: CUDA context, NCCL buffers, allocator slack
    efficiency: float = 1.0  # share of peak the matmuls reach (1.0: step times are lower bounds)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "gpu_memory_bytes", "intra_bytes_per_s",
                     "inter_bytes_per_s", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster {name} must be > 0, got {getattr(self, name)}; "
                                  f"pass a positive --{name.replace('_', '-')}")
        if not 0 < self.memory_fraction <= 1 or not 0 < self.efficiency <= 1:
            raise ConfigError("memory fraction and efficiency must be in (0, 1]; e.g. "
                              "--memory-fraction 0.9 --efficiency 0.5")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_limit(self) -> float:
        return self.gpu_memory_bytes * self.memory_fraction


@dataclass(frozen=True)
class Candidate:
    """One costed layout; `peak_flops` is the device peak its utilizations are relative to."""

    layout: Layout
    est: Estimate
    peak: PeakMemory  # the worst stage's peak on a GPU (`worst_stage_memory`): what the fit filter compares
    peak_flops: float = 0.0

    @property
    def memory(self) -> float:
        """Peak bytes per GPU (docs/estimator.md#peak-memory-what-a-rank-really-holds-at-its-worst-moment)."""
        return self.peak.total

    @property
    def step_seconds(self) -> float:
        """The ranked step time: DP traffic overlapped with compute (`step_seconds_overlapped`)."""
        return float(self.est.step_seconds_overlapped or 0.0)

    def utilization(self, flops_per_step: float | None) -> float | None:
        if not flops_per_step or not self.peak_flops or not self.step_seconds:
            return None
        return flops_per_step / self.layout.world / self.step_seconds / self.peak_flops

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization at the ranked step time (PaLM's numerator, recompute not counted)."""
        return self.utilization(self.est.model_flops_per_step)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs utilization: MFU x `hfu_ratio` (recompute counted from MFU's count), so HFU >= MFU always
        (a matmul-only count read below MFU for an untied model: PaLM's 6N counts the embedding gather)."""
        return None if self.mfu is None else self.mfu * self.est.hfu_ratio

    @property
    def dp_exposed_seconds(self) -> float:
        """Data-parallel traffic not hidden behind compute."""
        dp = self.est.comm_seconds.get("dp", 0.0)
        return max(0.0, dp - float(self.est.compute_seconds or 0.0))

    def to_dict(self) -> dict:
        """The estimate's fields, with the ranked (overlapped) quantities under the plain names the
        text table prints (`step_seconds`, `mfu`, `hfu`) and the no-overlap ones renamed."""
        d = self.est.to_dict()
        d["step_seconds_no_overlap"] = d.pop("step_seconds")
        d.pop("step_seconds_overlapped")
        d["mfu_no_overlap"] = d.pop("predicted_mfu")
        d["hfu_no_overlap"] = d.pop("predicted_hfu")
        comm = self.est.comm_bytes
        return {"layout": asdict(self.layout), "step_seconds": self.step_seconds, "mfu": self.mfu,
                "hfu": self.hfu, "pp_bytes_with_embedding": comm.get("pp", 0.0) + comm.get("embedding", 0.0),
                "peak_memory": self.peak.to_dict(), **d}


@dataclass
class Plan:
    """The ranked layouts (best first), how many were looked at, and why the first wins."""

    dims: ModelDims
    cluster: Cluster
    global_batch_size: int
    ranked: list[Candidate]
    considered: int  # layouts whose memory was computed
    costed: int  # layouts given a full estimate (fitting, Pareto-optimal)
    why: str
    prec: Precision = Precision()
    comparisons: list[Explained] = field(default_factory=list)  # `megalite.perfmodel.compare`, when asked

    def to_dict(self, top: int | None = None) -> dict:
        return {"model": asdict(self.dims), "params": dims_params(self.dims),
                "cluster": asdict(self.cluster), "world": self.cluster.world,
                "global_batch_size": self.global_batch_size, "considered": self.considered,
                "costed": self.costed, "why": self.why,
                "layouts": [c.to_dict() for c in self.ranked[:top]],
                "comparisons": [c.to_dict() for c in self.comparisons]}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def worst_stage_memory(dims: ModelDims, layout: Layout, prec: Precision) -> float:
    """Peak bytes per GPU over the pipeline stages, from the first and last stage only: `megalite.perfmodel.peak_memory`
    for a megalite run on a GPU (`PLANNER_PEAK`), the number the check before step 1 and `tools/estimate.py
    --memory-device cuda` give the same layout."""
    return peak_memory(dims, layout, prec, PLANNER_PEAK).total  # docs/estimator.md


def _model_splits(dims: ModelDims, cluster: Cluster, gbs: int,
                  cp_sizes: tuple[int, ...] = (1,)) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) with tp inside a node dividing the heads and the MLP, cp splitting the sequence
    into 2·cp chunks (S/cp tokens divisible by tp for SP), pp dividing the layers, dp = world / (tp·cp·pp)
    dividing the global batch."""
    out = []
    for tp in divisors(cluster.gpus_per_node):
        if dims.num_heads % tp or dims.kv_heads % tp or dims.ffn % tp:
            continue
        for cp in cp_sizes:
            if cp > 1 and (dims.seq_len % (2 * cp) or (dims.seq_len // cp) % tp):
                continue
            for pp in divisors(dims.num_layers):
                if cluster.world % (tp * cp * pp):
                    continue
                dp = cluster.world // (tp * cp * pp)
                if gbs % dp == 0:
                    out.append((tp, cp, pp, dp))
    return out


def auto_cp_sizes(dims: ModelDims, cluster: Cluster) -> tuple[int, ...]:
    """The cp sizes tried when nothing fits at cp = 1: powers of two up to the world size whose 2·cp
    chunks split the sequence evenly."""
    sizes, cp = [], 2
    while cp <= cluster.world and dims.seq_len % (2 * cp) == 0:
        sizes.append(cp)
        cp *= 2
    return tuple(sizes)


# The rules of thumb, in the order they break ties: (what is compared, sort key, the preferred side and why).
RULES: tuple[tuple[str, Callable[[Candidate], float], str], ...] = (
    ("dp", lambda c: -c.layout.dp, "the larger dp (its traffic overlaps the backward pass)"),
    ("pp", lambda c: c.layout.pp, "fewer pipeline stages (no bubble to grow when kernels run below peak)"),
    ("cp", lambda c: c.layout.cp, "the smaller cp (no K/V ring whose transfers must hide behind attention)"),
    ("zero", lambda c: c.layout.zero, "the lower ZeRO stage (fewer collectives per step)"),
    ("recompute", lambda c: RECOMPUTE.index(c.layout.recompute), "less recompute"),
    ("vpp", lambda c: c.layout.vpp, "fewer virtual stages (fewer point-to-point sends)"),
    ("mbs", lambda c: -c.layout.micro_batch_size,
     "the larger micro-batch (larger matmuls run closer to peak on real kernels, which the estimator "
     "does not model)"),
    ("memory", lambda c: c.memory, "less memory"),
)


def _rules_key(c: Candidate) -> tuple:
    """The rules of thumb as a tie-break (`RULES`): dp largest, then pp smallest, then cp (tp is what remains),
    then less ZeRO, less recompute, fewer virtual stages, larger micro-batches, less memory."""
    return tuple(key(c) for _, key, _ in RULES)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first, except that every layout within TIE_TOLERANCE of the fastest counts as a tie
    and those are ordered by the rules of thumb (`_rules_key`)."""
    if not candidates:
        return []
    fastest = min(c.step_seconds for c in candidates)
    tied = [c for c in candidates if c.step_seconds <= fastest * (1 + TIE_TOLERANCE)]
    rest = [c for c in candidates if c.step_seconds > fastest * (1 + TIE_TOLERANCE)]
    return sorted(tied, key=_rules_key) + sorted(rest, key=lambda c: (c.step_seconds, _rules_key(c)))


@dataclass(frozen=True)
class Search:
    """Which layouts `make_plan` tries: micro-batch sizes up to `max_micro_batch`, vpp up to `max_vpp`, the
    ZeRO stages, the pipeline schedules and the context-parallel sizes (`make_plan`'s doc for the last two)."""

    max_micro_batch: int = 16
    max_vpp: int = 8
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    cp_sizes: tuple[int, ...] | None = None


def make_plan(dims: ModelDims, cluster: Cluster, global_batch_size: int, prec: Precision = Precision(),
              search: Search = Search()) -> Plan:
    """Enumerate, filter by memory, cost and rank the layouts of `dims` on `cluster` that `search` allows.

    `schedules` are the pipeline schedules tried where pp > 1 (1F1B is always the fallback at vpp = 1);
    the zero-bubble ones (`zb-h1`, `zbv`: Qi et al. 2024) are opt-in, since the estimator prices them at
    equal forward / input-gradient / weight-gradient costs, their best case. `cp_sizes` are the context-
    parallel sizes tried; None: cp = 1, then `auto_cp_sizes` if no layout fits (the plan's `why` says so).

    Raises ConfigError with the smallest memory found when no layout fits, or when the batch and
    the world size admit no split at all."""
    gbs = global_batch_size
    max_micro_batch, max_vpp, zero_stages, schedules, cp_sizes = (search.max_micro_batch, search.max_vpp,
                                                                 search.zero_stages, search.schedules, search.cp_sizes)
    if gbs < 1:
        raise ConfigError(f"global batch size must be >= 1, got {gbs}; pass --global-batch-size")
    if cp_sizes is None:
        try:
            return make_plan(dims, cluster, gbs, prec, replace(search, cp_sizes=(1,)))
        except ConfigError as exc:
            longer = auto_cp_sizes(dims, cluster)
            if not longer or "fits on no layout" not in str(exc):
                raise
            try:
                plan = make_plan(dims, cluster, gbs, prec, replace(search, cp_sizes=longer))
            except ConfigError as again:
                raise ConfigError(f"{again} (context parallelism tried too: cp = "
                                  f"{', '.join(map(str, longer))})") from None
            plan.why = (f"no layout fits at cp = 1, so context parallelism was tried (cp = "
                        f"{', '.join(map(str, longer))}); " + plan.why)
            return plan
    if any(cp < 1 for cp in cp_sizes):
        raise ConfigError(f"cp sizes must be >= 1, got {cp_sizes}; e.g. --cp 1,2,4")
    splits = _model_splits(dims, cluster, gbs, cp_sizes)
    if not splits:
        raise ConfigError(f"no (tp, pp, dp) split of {cluster.world} GPUs fits the model and batch: tp "
                          f"must divide {cluster.gpus_per_node} GPUs/node and {dims.num_heads} heads, pp "
                          f"{dims.num_layers} layers, dp the global batch {gbs}, cp (sizes "
                          f"{', '.join(map(str, cp_sizes))}) split the {dims.seq_len}-token sequence into 2·cp "
                          f"chunks; use a global batch that is a multiple of the GPU count")
    considered = 0
    smallest: tuple[float, Layout] | None = None
    ranked: list[Candidate] = []
    for tp, cp, pp, dp in splits:
        per_replica = gbs // dp
        for mbs in (b for b in divisors(per_replica) if b <= max_micro_batch):
            m = per_replica // mbs
            if m < pp:
                continue  # stages idle most of the step; fewer, larger micro-batches never help here
            vpps = [v for v in range(1, max_vpp + 1)
                    if (dims.num_layers // pp) % v == 0 and (v == 1 or (pp > 1 and m % pp == 0))]
            for vpp, sched in ((v, s) for v in vpps for s in _schedules_for(v, pp, dims, schedules)):
                base = Layout(tp=tp, pp=pp, dp=dp, sp=tp > 1, vpp=vpp, schedule=sched,
                              micro_batch_size=mbs, global_batch_size=gbs, cp=cp)
                best_zero = len(zero_stages)  # Pareto front: a recompute level must lower the ZeRO stage
                for rc in RECOMPUTE:
                    for zi, zero in enumerate(zero_stages[:best_zero]):
                        if dp * cp == 1 and zero > 0:
                            break  # ZeRO over one rank shards nothing
                        lay = replace(base, zero=zero, recompute=rc)
                        peak = peak_memory(dims, lay, prec, PLANNER_PEAK)
                        mem = peak.total
                        considered += 1
                        if smallest is None or mem < smallest[0]:
                            smallest = (mem, lay)
                        if fits(mem, cluster.memory_limit):
                            ranked.append(cost(dims, lay, cluster, prec, peak))
                            best_zero = zi
                            break
                    if best_zero == 0:
                        break
    if smallest is None:  # every split left fewer micro-batches per replica than pipeline stages
        raise ConfigError(f"global batch {gbs} is too small for {cluster.world} GPUs: every (tp, pp, dp) split "
                          f"leaves a pipeline with fewer micro-batches than stages (or a micro-batch above "
                          f"{max_micro_batch}); use a global batch of at least {cluster.world} (a multiple of the "
                          "GPU count), or fewer nodes")
    if not ranked:
        mem, lay = smallest
        raise ConfigError(
            f"the model ({dims_params(dims) / 1e9:.1f} B parameters) fits on no layout of "
            f"{cluster.world} GPUs: the smallest needs {mem / GB:.1f} GB per GPU ({describe(lay)}) "
            f"but {cluster.memory_limit / GB:.1f} GB is usable; add nodes, use GPUs with more memory, "
            f"or shorten --seq-len")
    ranked = rank(ranked)
    return Plan(dims, cluster, gbs, ranked, considered, len(ranked), explain(ranked, cluster), prec)


def cost(dims: ModelDims, lay: Layout, cluster: Cluster, prec: Precision, peak: PeakMemory | None = None) -> Candidate:
    """The full estimate of one layout on `cluster` (one node: everything on NVLink; a cp ring of tp·cp ranks
    that fits in a node, too); `peak`: its `worst_stage_memory` when the caller has it already."""
    inter = cluster.intra_bytes_per_s if cluster.nodes == 1 else cluster.inter_bytes_per_s
    ring = cluster.intra_bytes_per_s if cluster.gpus_per_node % (lay.tp * lay.cp) == 0 else inter
    est = estimate(dims, lay, prec, hw=Hardware(peak_flops=cluster.peak_flops, inter_bytes_per_s=inter,
                                              intra_bytes_per_s=cluster.intra_bytes_per_s,
                                              efficiency=cluster.efficiency, cp_bytes_per_s=ring))
    return Candidate(lay, est, peak or peak_memory(dims, lay, prec, PLANNER_PEAK), cluster.peak_flops)


def _parts(c: Candidate) -> dict[str, float]:
    """Where a step's time goes (the DP traffic counts only where compute does not hide it)."""
    sec = c.est.comm_seconds
    return {"compute and bubble": float(c.est.compute_seconds or 0.0), "TP traffic": sec.get("tp", 0.0),
            "PP sends": sec.get("pp", 0.0) + sec.get("embedding", 0.0),
            "exposed DP traffic": c.dp_exposed_seconds, "exposed cp ring": float(c.est.cp_exposed_seconds or 0.0)}


def _schedules_for(vpp: int, pp: int, dims: ModelDims, allowed: tuple[str, ...]) -> list[str]:
    """The schedules a (pp, vpp) split can run: 1F1B or ZB-H1 at vpp = 1, interleaved at vpp > 1, ZB-V at
    vpp = 2 with untied embeddings (its V puts the embedding and the head on one rank)."""
    if pp == 1:
        return ["1f1b"] if vpp == 1 else []
    if vpp == 1:
        return ["1f1b"] + (["zb-h1"] if "zb-h1" in allowed else [])
    return ([s for s in ("interleaved",) if s in allowed]
            + (["zbv"] if "zbv" in allowed and vpp == 2 and not dims.tied else []))


def describe(lay: Layout) -> str:
    sched = f" schedule={lay.schedule}" if lay.schedule not in ("1f1b", "interleaved") else ""
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    return (f"tp={lay.tp}{cp} pp={lay.pp} dp={lay.dp} zero={lay.zero} vpp={lay.vpp} "
            f"mbs={lay.micro_batch_size} recompute={lay.recompute}{sched}")


_FIELDS = (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("zero", "zero"), ("vpp", "vpp"),
           ("micro_batch_size", "mbs"), ("recompute", "recompute"), ("schedule", "schedule"))


def differences(a: Layout, b: Layout) -> str:
    """What actually differs between two layouts, e.g. 'mbs 4 vs 2'."""
    return ", ".join(f"{short} {getattr(a, name)} vs {getattr(b, name)}" for name, short in _FIELDS
                     if getattr(a, name) != getattr(b, name)) or "nothing"


def versus(best: Candidate, other: Candidate) -> str:
    """Why `best` ranks above `other`: a tie broken by the first rule that differs (named, with the
    memory it costs when the winner needs more), or where in the step `other` loses its time.
    Differences are written winner first: 'tp 4 vs 8'."""
    slower = other.step_seconds / best.step_seconds - 1
    diff = "winner vs it: " + differences(best.layout, other.layout)
    mem_a, mem_b = best.memory, other.memory
    if slower < TIE_TOLERANCE:
        rule = next((why for _, key, why in RULES if key(best) != key(other)), "the enumeration order")
        line = f"within {TIE_TOLERANCE:.0%} ({slower:+.2%}, a tie; {diff}); the tie goes to {rule}"
        if mem_a > mem_b:
            line += (f", at {(mem_a - mem_b) / GB:.1f} GB more memory per GPU ({mem_a / GB:.1f} vs "
                     f"{mem_b / GB:.1f} GB)")
        return line
    a, b = _parts(best), _parts(other)
    part = max(a, key=lambda k: b[k] - a[k])
    by_part = ", ".join(f"{k} {a[k]:.3g} vs {b[k]:.3g} s" for k in a if a[k] or b[k])
    return (f"{slower:.1%} slower ({best.step_seconds:.3g} vs {other.step_seconds:.3g} s/step; {diff}), "
            f"most of it in {part}; by part, {by_part}; memory {mem_a / GB:.1f} vs {mem_b / GB:.1f} GB")


def explain(ranked: list[Candidate], cluster: Cluster) -> str:
    """One line on why the first layout wins: its time and memory budget, and why the runner-up
    ranks below it (`versus`)."""
    best = ranked[0]
    peak = best.peak
    line = (f"{describe(best.layout)} wins at {best.step_seconds:.3g} s/step: it fits in "
            f"{peak.total / GB:.1f} of {cluster.memory_limit / GB:.1f} GB ({peak.model_states / GB:.1f} states + "
            f"{(peak.total - peak.model_states) / GB:.1f} activations, buffers and context), bubble "
            f"{best.est.bubble:.1%}, TP traffic "
            f"{best.est.comm_bytes.get('tp', 0.0) / GB:.2f} GB on NVLink")
    if best.layout.cp > 1:
        line += (f", cp ring {best.est.comm_bytes.get('cp', 0.0) / GB:.2f} GB "
                 f"({float(best.est.cp_exposed_seconds or 0.0):.3g} s of it not hidden behind attention)")
    if len(ranked) > 1:
        line += f"; the runner-up ({describe(ranked[1].layout)}) is " + versus(best, ranked[1])
    return line
