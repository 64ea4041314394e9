"""The planner for mixture-of-experts models: expert parallelism ranked with the other dimensions.

`make_moe_plan` enumerates (tp, pp, dp, ep, ZeRO, micro-batch, recompute) at vpp = 1, 1F1B and cp = 1, where
ep divides dp and the experts, drops what does not fit and ranks the rest by predicted step time, as
`megalite.perfmodel.plan` does for a dense model (its ZeRO / recompute Pareto front and its tie tolerance).
Per layout (`moe_cost`):

* compute, TP, PP and DP traffic: `plan.cost` of the *active* model (`active_dims`: each MoE layer's MLP
  as one dense MLP of the width a token uses, k F + the shared experts), so FLOPs count active parameters;
* memory per GPU: the peak the check before step 1 predicts on a GPU (`megalite.perfmodel.peak_memory`, the
  dense planner's `PLANNER_PEAK`): experts split over ep with their ZeRO states over edp = dp x cp / ep, the
  rest over dp x cp, each MoE layer's routed rows and router tensors saved for the backward, the CUDA context
  and the caching allocator's slack;
* the all-to-all (`moe.costs.a2a_bytes_balanced`, balanced routing), on the step's critical path (megalite's
  dispatch and combine are synchronous), at the intra-node bandwidth when every ep group lies inside a
  node and at the network's otherwise. Whether it does is read from the layout's rank grid
  (`parallel.state.layout_grid`, `ep_crosses_nodes`): with rank order tp, cp, dp, pp an ep group spans
  tp x ep consecutive ranks, so it crosses when tp x ep exceeds the GPUs per node.

Not modelled: the experts' gradient reduction over edp is priced as the active MLP's over dp (both overlap
the backward); load imbalance (a measured max/mean load multiplies the busiest rank's expert compute).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from megalite.model.spec import ModelSpec
from megalite.moe.settings import moe_settings
from megalite.parallel.state import layout_grid
from megalite.perfmodel.config_inputs import spec_dims
from megalite.perfmodel.estimate import GB, Layout, ModelDims, Precision
from megalite.perfmodel.moe import moe_estimate, moe_param_counts
from megalite.perfmodel.peak_memory import PLANNER_PEAK, fits, peak_memory
from megalite.perfmodel.plan import RECOMPUTE, TIE_TOLERANCE, Cluster, cost, divisors
from megalite.errors import ConfigError


def active_dims(m: ModelSpec) -> ModelDims:
    """The dense model a token sees: every MLP of the width it computes with (k experts + the shared ones)."""
    s = moe_settings(m)
    if s is None:
        raise ConfigError("the MoE planner needs a model with experts (moe.experts > 0)")
    width = s.top_k * s.ffn_hidden_size + s.shared_experts * s.shared_ffn_hidden_size
    return ModelDims(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                     vocab_size=m.vocab_size, seq_len=m.seq_len, arch=m.arch, num_kv_heads=m.num_kv_heads,
                     ffn_hidden_size=max(width, m.ffn_hidden_size), tie_embeddings=bool(m.tie_embeddings),
                     make_vocab_divisible_by=m.make_vocab_divisible_by or 1)


def ep_crosses_nodes(lay: Layout, ep: int, gpus_per_node: int) -> bool:
    """Whether some ep group holds ranks of two nodes (node = rank // gpus_per_node), from the rank grid."""
    grid = layout_grid(tp=lay.tp, cp=lay.cp, dp=lay.dp, pp=lay.pp, ep=ep)
    nodes: dict[tuple, set[int]] = {}
    for r in range(grid.world):
        c = grid.coords(r)
        nodes.setdefault((c["tp"], c["pp"], c["edp"]), set()).add(r // gpus_per_node)
    return any(len(n) > 1 for n in nodes.values())


def moe_model_dims(m: ModelSpec, pp: int = 1) -> ModelDims:
    """The model as the peak memory model sizes it: its own MLP width, attention and experts (`MoEDims`). Where pp
    does not divide the layers (DeepSeek-V3's 61 over 16 stages) the worst stage holds ceil(L / pp) of them: the
    model is padded to that many per stage with MoE layers."""
    dims = spec_dims(m)
    layers = math.ceil(m.num_layers / pp) * pp
    if dims.moe is None or layers == m.num_layers:
        return replace(dims, num_layers=layers)
    padding = tuple(range(m.num_layers, layers))
    return replace(dims, num_layers=layers, moe=replace(dims.moe, layers=dims.moe.layers + padding))


def moe_memory(m: ModelSpec, lay: Layout, ep: int, prec: Precision) -> tuple[float, float]:
    """(model-state bytes, the rest of the peak) per GPU on the worst stage: `megalite.perfmodel.peak_memory` on a GPU
    (`PLANNER_PEAK`), the number the check before step 1 gives this layout (docs/estimator.md)."""
    peak = peak_memory(moe_model_dims(m, lay.pp), replace(lay, ep=ep), prec, PLANNER_PEAK)
    return peak.model_states, peak.total - peak.model_states


@dataclass(frozen=True)
class MoECandidate:
    layout: Layout
    ep: int
    states_bytes: float       # model states (and ZeRO-3's gather buffers) per GPU
    transient_bytes: float    # the rest of the peak: activations, buffers, the CUDA context, allocator slack
    dense_seconds: float      # the active model's step (compute + TP/PP + exposed DP), `plan.cost`
    a2a_bytes: float          # all-to-all bytes per rank and step
    a2a_seconds: float
    crosses_nodes: bool       # some ep group spans two nodes: the all-to-all runs at the network's bandwidth

    @property
    def memory(self) -> float:
        return self.states_bytes + self.transient_bytes

    @property
    def step_seconds(self) -> float:
        return self.dense_seconds + self.a2a_seconds

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "ep": self.ep, "edp": self.layout.dp * self.layout.cp // self.ep,
                "memory": self.memory, "states": self.states_bytes, "transient": self.transient_bytes,
                "step_seconds": self.step_seconds, "a2a_seconds": self.a2a_seconds, "a2a_bytes": self.a2a_bytes,
                "a2a_crosses_nodes": self.crosses_nodes}


def moe_cost(m: ModelSpec, lay: Layout, ep: int, cluster: Cluster, prec: Precision,
             memory: tuple[float, float] | None = None) -> MoECandidate:
    """One layout's step time and all-to-all; `memory`: its `moe_memory` when the caller has it already."""
    states, acts = memory or moe_memory(m, lay, ep, prec)
    dense = cost(active_dims(m), lay, cluster, prec).step_seconds
    a2a = moe_estimate(m, lay, ep, prec).ep_bytes_per_step  # balanced routing, `moe` module doc
    crosses = ep > 1 and ep_crosses_nodes(lay, ep, cluster.gpus_per_node)
    bw = cluster.inter_bytes_per_s if crosses else cluster.intra_bytes_per_s
    return MoECandidate(lay, ep, states, acts, dense, a2a, a2a / bw, crosses)


@dataclass
class MoEPlan:
    params_total: float
    params_active: float
    cluster: Cluster
    ranked: list[MoECandidate]
    considered: int
    why: str

    def to_dict(self, top: int | None = None) -> dict:
        return {"params_total": self.params_total, "params_active": self.params_active,
                "cluster": asdict(self.cluster), "considered": self.considered, "costed": len(self.ranked),
                "why": self.why, "layouts": [c.to_dict() for c in self.ranked[:top]]}


def _tie_key(c: MoECandidate) -> tuple:
    """Ties (within TIE_TOLERANCE) go to an all-to-all inside a node, then the dense planner's rules: larger
    dp, fewer stages, lower ZeRO, less recompute, larger micro-batches; then the larger ep (less memory)."""
    lay = c.layout
    return (c.crosses_nodes, -lay.dp, lay.pp, lay.zero, RECOMPUTE.index(lay.recompute), -lay.micro_batch_size,
            -c.ep, c.memory)


def make_moe_plan(m: ModelSpec, cluster: Cluster, global_batch_size: int, prec: Precision = Precision(),
                  max_micro_batch: int = 16, zero_stages: tuple[int, ...] = (0, 1, 2, 3)) -> MoEPlan:
    """Enumerate, filter by memory, cost and rank the layouts of MoE model config `m` (resolved) on `cluster`."""
    s = moe_settings(m)
    if s is None:
        raise ConfigError("the MoE planner needs a model with experts (moe.experts > 0)")
    gbs = global_batch_size
    considered, ranked, smallest = 0, [], math.inf
    for tp in divisors(cluster.gpus_per_node):
        shared = s.shared_experts * s.shared_ffn_hidden_size
        if m.num_heads % tp or m.num_kv_heads % tp or m.ffn_hidden_size % tp or shared % tp:
            continue
        for pp in (p for p in divisors(m.num_layers) if cluster.world % (tp * p) == 0):
            dp = cluster.world // (tp * pp)
            if gbs % dp:
                continue
            for ep in (e for e in divisors(dp) if s.experts % e == 0):
                for mbs in (b for b in divisors(gbs // dp) if b <= max_micro_batch and gbs // dp // b >= pp):
                    base = Layout(tp=tp, pp=pp, dp=dp, sp=tp > 1, micro_batch_size=mbs, global_batch_size=gbs)
                    best_zero = len(zero_stages)  # the dense planner's Pareto front of (zero, recompute)
                    for rc in RECOMPUTE:
                        for zi, zero in enumerate(zero_stages[:best_zero]):
                            if dp == 1 and zero > 0:
                                break
                            lay = replace(base, zero=zero, recompute=rc)
                            parts = moe_memory(m, lay, ep, prec)
                            mem = sum(parts)
                            considered += 1
                            smallest = min(smallest, mem)
                            if fits(mem, cluster.memory_limit):
                                ranked.append(moe_cost(m, lay, ep, cluster, prec, parts))
                                best_zero = zi
                                break
                        if best_zero == 0:
                            break
    counts = moe_param_counts(m)
    if not ranked:
        raise ConfigError(f"the MoE model ({counts.total / 1e9:.1f} B parameters) fits on no layout of "
                          f"{cluster.world} GPUs" + (f": the smallest needs {smallest / GB:.1f} GB per GPU but "
                                                     f"{cluster.memory_limit / GB:.1f} GB is usable" if considered else
                                                     f" with global batch {gbs}") + "; add nodes or GPUs with more memory")
    fastest = min(c.step_seconds for c in ranked)
    tied = sorted((c for c in ranked if c.step_seconds <= fastest * (1 + TIE_TOLERANCE)), key=_tie_key)
    rest = sorted((c for c in ranked if c.step_seconds > fastest * (1 + TIE_TOLERANCE)),
                  key=lambda c: (c.step_seconds, _tie_key(c)))
    ranked = tied + rest
    return MoEPlan(float(counts.total), float(counts.active), cluster, ranked, considered, _why(ranked, cluster))


def describe_moe(c: MoECandidate) -> str:
    lay = c.layout
    return (f"tp={lay.tp} pp={lay.pp} dp={lay.dp} ep={c.ep} (edp={lay.dp // c.ep}) zero={lay.zero} "
            f"mbs={lay.micro_batch_size} recompute={lay.recompute}")


def _where(c: MoECandidate, cluster: Cluster) -> str:
    span = c.layout.tp * c.ep
    if c.ep == 1:
        return "no all-to-all (ep=1)"
    side = (f"crosses the node boundary (ep x tp = {span} > {cluster.gpus_per_node} GPUs per node: network "
            "bandwidth)" if c.crosses_nodes else f"stays inside a node (ep x tp = {span} <= {cluster.gpus_per_node})")
    return f"all-to-all {c.a2a_bytes / GB:.3g} GB/step/rank, {c.a2a_seconds:.3g} s, {side}"


def _why(ranked: list[MoECandidate], cluster: Cluster) -> str:
    best = ranked[0]
    line = (f"{describe_moe(best)} wins at {best.step_seconds:.3g} s/step in {best.memory / GB:.1f} of "
            f"{cluster.memory_limit / GB:.1f} GB ({best.states_bytes / GB:.1f} states + "
            f"{best.transient_bytes / GB:.1f} activations, buffers and context); {_where(best, cluster)}")
    other = next((c for c in ranked if c.crosses_nodes != best.crosses_nodes and c.ep > 1), None)
    if other is not None:
        line += (f"; the best layout whose all-to-all {'crosses nodes' if other.crosses_nodes else 'stays in a node'}"
                 f" ({describe_moe(other)}) takes {other.step_seconds:.3g} s/step, all-to-all {other.a2a_seconds:.3g} s")
    return line


def render_moe(plan: MoEPlan, top: int) -> str:
    c = plan.cluster
    out = [f"mixture of experts: {plan.params_total / 1e9:.2f} B total, {plan.params_active / 1e9:.2f} B active "
           f"parameters; {c.nodes} x {c.gpus_per_node} GPUs, {c.memory_limit / GB:.0f} GB usable each",
           f"{plan.considered} layouts sized, {len(plan.ranked)} fit and were costed (vpp=1, 1F1B, cp=1)", "",
           f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5} {'ep':>4} {'edp':>4} {'zero':>4} {'mbs':>3} {'recomp':>9} "
           f"{'step s':>8} {'a2a s':>7} {'a2a GB':>7} {'a2a over':>8} {'mem GB':>7} {'states':>7} {'rest':>6}"]
    for i, cand in enumerate(plan.ranked[:top], 1):
        lay = cand.layout
        over = "-" if cand.ep == 1 else ("network" if cand.crosses_nodes else "node")
        out.append(f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {cand.ep:>4} {lay.dp // cand.ep:>4} {lay.zero:>4} "
                   f"{lay.micro_batch_size:>3} {lay.recompute:>9} {cand.step_seconds:>8.3f} {cand.a2a_seconds:>7.3f} "
                   f"{cand.a2a_bytes / GB:>7.2f} {over:>8} {cand.memory / GB:>7.1f} {cand.states_bytes / GB:>7.1f} "
                   f"{cand.transient_bytes / GB:>6.1f}")
    out += ["", "why: " + plan.why]
    return "\n".join(out)
