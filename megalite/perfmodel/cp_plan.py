"""Which context-parallel mode to run a planned layout with: ring vs all-gather vs a2a vs hybrid, ranked by
predicted step time, with the reason (`tools/plan.py` prints it under the plan; megalite/context has the modes).

For a layout with cp > 1 every mode the heads allow is costed by the estimator on the cluster
(`megalite.perfmodel.plan.cost`): the ring's transfers hide behind attention compute step by step, the
all-gather's and the all-to-all's are exposed, and hybrid's all-to-all runs inside a node whenever its
tp x cp_a2a ranks fit one (the rank order tp, cp, dp, pp puts them there) while its ring crosses nodes.
What decides, in practice (docs/parallelism.md):

- few kv heads (GQA) and a ring whose blocks hide their transfers: ring (no extra memory);
- many heads, a fast all-to-all (one node): a2a moves ~(2 hq + 2 hk) / ((cp-1) 2 hk (2e+4)/e) of the ring's bytes,
  independent of cp, but exposed;
- cp beyond the head count or beyond a node: hybrid, the all-to-all on NVLink and a ring cp_a2a times shorter;
- the all-gather moves the fewest K/V bytes but holds the whole sequence's K/V: when memory allows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megalite.perfmodel.context import ring_exposed_seconds
from megalite.perfmodel.estimate import GB, Layout, ModelDims, Precision
from megalite.perfmodel.peak_memory import fits
from megalite.perfmodel.plan import Cluster, cost, divisors


@dataclass(frozen=True)
class ModeCost:
    """One cp mode of a layout, costed."""

    layout: Layout
    step_seconds: float     # the planner's ranked time (DP traffic overlapped), hybrid's all-to-all at its speed
    cp_bytes: float         # bytes one rank sends over cp per step
    exposed_seconds: float  # cp transfers not hidden behind compute
    memory: float           # worst stage's bytes per device
    fits: bool

    @property
    def label(self) -> str:
        lay = self.layout
        if lay.cp_mode == "hybrid":
            return f"hybrid (a2a {lay.cp_a2a} x ring {lay.cp // lay.cp_a2a})"
        return lay.cp_mode

    def to_dict(self) -> dict:
        return {"mode": self.layout.cp_mode, "cp_a2a": self.layout.cp_a2a, "step_seconds": self.step_seconds,
                "cp_bytes": self.cp_bytes, "cp_exposed_seconds": self.exposed_seconds, "memory_bytes": self.memory,
                "fits": self.fits}


def mode_layouts(dims: ModelDims, layout: Layout) -> list[Layout]:
    """`layout` in every cp mode its heads allow: ring, allgather, a2a (heads/tp divisible by cp) and hybrid for
    each a2a degree 1 < a < cp dividing cp and the heads."""
    heads, kv = dims.num_heads // layout.tp, dims.kv_heads // layout.tp
    out = [replace(layout, cp_mode="ring", cp_a2a=1), replace(layout, cp_mode="allgather", cp_a2a=1)]
    if heads % layout.cp == 0 and kv % layout.cp == 0:
        out.append(replace(layout, cp_mode="a2a", cp_a2a=1))
    out += [replace(layout, cp_mode="hybrid", cp_a2a=a) for a in divisors(layout.cp)
            if 1 < a < layout.cp and heads % a == 0 and kv % a == 0]
    return out


def mode_cost(dims: ModelDims, lay: Layout, cluster: Cluster, prec: Precision) -> ModeCost:
    """The estimate of `lay` on `cluster`; hybrid's all-to-all priced at NVLink speed when its tp x cp_a2a ranks
    fit a node (the estimator prices every cp byte at one speed, the ring's)."""
    cand = cost(dims, lay, cluster, prec)
    est, step = cand.est, cand.step_seconds
    exposed = float(est.cp_exposed_seconds or 0.0)
    if lay.cp_mode == "hybrid" and cluster.gpus_per_node % (lay.tp * lay.cp_a2a) == 0 and est.compute_seconds:
        inter = cluster.intra_bytes_per_s if cluster.nodes == 1 else cluster.inter_bytes_per_s
        ring = cluster.intra_bytes_per_s if cluster.gpus_per_node % (lay.tp * lay.cp) == 0 else inter
        fixed = ring_exposed_seconds(dims, lay, prec, est.num_microbatches, cluster.peak_flops * cluster.efficiency,
                                     ring, inner_bytes_per_s=cluster.intra_bytes_per_s)
        step, exposed = step - exposed + fixed, fixed
    mem = cand.memory
    return ModeCost(lay, step, est.comm_bytes.get("cp", 0.0), exposed, mem, fits(mem, cluster.memory_limit))


@dataclass
class CpModeRanking:
    """The cp modes of one layout, fastest fitting first, and why (an `Explained` for the plan's comparisons)."""

    ranked: list[ModeCost]
    explanation: str

    def to_dict(self) -> dict:
        return {"kind": "cp_modes", "explanation": self.explanation, "modes": [m.to_dict() for m in self.ranked]}


def rank_cp_modes(dims: ModelDims, layout: Layout, cluster: Cluster, prec: Precision) -> CpModeRanking:
    """Every cp mode of `layout` by predicted step time (layouts that do not fit in memory last), explained."""
    costs = sorted((mode_cost(dims, lay, cluster, prec) for lay in mode_layouts(dims, layout)),
                   key=lambda c: (not c.fits, c.step_seconds))
    return CpModeRanking(costs, explain_modes(costs, cluster))


def explain_modes(costs: list[ModeCost], cluster: Cluster) -> str:
    """One line: the winner, every mode's time, and the reason the winner beats the runner-up."""
    best = costs[0]
    times = ", ".join(f"{c.label} {c.step_seconds:.4g} s" + ("" if c.fits else " (does not fit)") for c in costs)
    line = f"cp mode: {best.label} is fastest ({times})"
    if not best.fits:
        return line + f"; none fits in {cluster.memory_limit / GB:.1f} GB per GPU"
    if len(costs) < 2:
        return line
    other = costs[1]
    if not other.fits:
        return line + f"; {other.label} needs {other.memory / GB:.1f} GB of {cluster.memory_limit / GB:.1f}"
    why = (f"{best.cp_bytes / GB:.3g} GB of cp traffic per step, {best.exposed_seconds:.3g} s of it exposed, vs "
           f"{other.label}'s {other.cp_bytes / GB:.3g} GB, {other.exposed_seconds:.3g} s exposed")
    if best.layout.cp_mode == "ring" and best.exposed_seconds < other.exposed_seconds:
        why += " (the ring hides its transfers behind attention)"
    elif best.layout.cp_mode == "hybrid":
        why += " (its all-to-all stays inside a node, its ring is cp_a2a times shorter)"
    return line + "; because " + why
