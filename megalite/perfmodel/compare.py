"""The planner's ranking explained against a layout the user names, or a published one by name:
`tools/plan.py --compare tp=8,pp=8,recompute=full`, `--compare megatron`."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.errors import ConfigError
from megalite.perfmodel.estimate import GB, Layout
from megalite.perfmodel.peak_memory import fits
from megalite.perfmodel.plan import Candidate, Plan, cost, describe, versus

# Published layouts by name (`--compare megatron`): (the layout's fields, where it comes from).
PUBLISHED: dict[str, tuple[str, str]] = {
    "megatron": ("tp=8,pp=8", "Megatron-LM's tp=8 x pp=8 for GPT-3-sized models, Narayanan et al. 2021, Table 1"),
    "zero3-dp": ("tp=1,pp=1,zero=3", "pure data parallelism with ZeRO-3, Rajbhandari et al. 2020"),
}

_SPEC = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "zero": "zero", "vpp": "vpp", "mbs": "micro_batch_size",
         "recompute": "recompute"}


def parse_layout_spec(text: str) -> dict[str, int | str]:
    """'tp=8,pp=8,recompute=full' -> {'tp': 8, 'pp': 8, 'recompute': 'full'} (keys of `_SPEC`), or a
    `PUBLISHED` name."""
    if text in PUBLISHED:
        text = PUBLISHED[text][0]
    out: dict[str, int | str] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in _SPEC or not value.strip():
            raise ConfigError(f"--compare {text!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(_SPEC)}, "
                              f"nor a published layout ({', '.join(PUBLISHED)}); e.g. --compare tp=8,pp=8")
        if key == "recompute":
            out[key] = value.strip()
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"--compare {text!r}: {key} must be an integer, got {value.strip()!r}") from None
    if not out:
        raise ConfigError("--compare needs at least one KEY=VALUE, e.g. --compare tp=8,pp=8")
    return out


@dataclass(frozen=True)
class Comparison:
    """A layout the user asked about (e.g. a published one) set against the planner's winner."""

    spec: str
    rank: int | None  # 1-based place in the plan's ranking; None: not among the costed layouts
    fits: bool
    candidate: Candidate
    explanation: str

    def to_dict(self) -> dict:
        return {"spec": self.spec, "rank": self.rank, "fits": self.fits, "explanation": self.explanation,
                **self.candidate.to_dict()}


def compare(plan: Plan, spec: str) -> Comparison:
    """Explain the plan's ranking against the layout `spec` names (fields left out are free): its best
    variant among the costed layouts, or, when the search did not cost it (it does not fit, or a lower
    ZeRO stage or less recompute fits with the same split), that exact layout costed now."""
    want = parse_layout_spec(spec)
    if spec in PUBLISHED:
        spec = f"{spec} ({PUBLISHED[spec][1]}: {PUBLISHED[spec][0]})"
    best = plan.ranked[0]
    for i, cand in enumerate(plan.ranked, 1):
        if all(getattr(cand.layout, _SPEC[k]) == v for k, v in want.items()):
            why = "it is the planner's pick" if i == 1 else "it is " + versus(best, cand)
            return Comparison(spec, i, True, cand, f"{spec}: best variant {describe(cand.layout)} ranks #{i} of "
                                                   f"{len(plan.ranked)} at {cand.step_seconds:.3g} s/step; {why}")
    tp, pp, cp = int(want.get("tp", 1)), int(want.get("pp", 1)), int(want.get("cp", 1))
    world = plan.cluster.world
    dp = int(want.get("dp", world // (tp * cp * pp) if world % (tp * cp * pp) == 0 else 0))
    if tp * cp * pp * dp != world:
        raise ConfigError(f"--compare {spec!r}: tp x cp x pp x dp must be the {world} GPUs of the cluster")
    vpp = int(want.get("vpp", 1))
    try:
        lay = Layout(tp=tp, pp=pp, dp=dp, zero=int(want.get("zero", 0)), sp=tp > 1, vpp=vpp,
                     schedule="interleaved" if vpp > 1 else "1f1b", micro_batch_size=int(want.get("mbs", 1)),
                     global_batch_size=plan.global_batch_size, recompute=str(want.get("recompute", "none")), cp=cp)
        cand = cost(plan.dims, lay, plan.cluster, plan.prec)
    except ConfigError as exc:
        raise ConfigError(f"--compare {spec}: {exc}") from None
    peak = cand.peak
    if not fits(peak.total, plan.cluster.memory_limit):
        return Comparison(spec, None, False, cand,
                          f"{spec}: {describe(lay)} does not fit: {peak.total / GB:.1f} GB per GPU "
                          f"({peak.model_states / GB:.1f} states + {(peak.total - peak.model_states) / GB:.1f} "
                          f"activations, buffers and context) of {plan.cluster.memory_limit / GB:.1f} GB usable")
    return Comparison(spec, None, True, cand,
                      f"{spec}: {describe(lay)} fits ({peak.total / GB:.1f} GB) but the search did not cost it "
                      f"(a lower ZeRO stage or less recompute fits with the same split, or m < pp); it is "
                      + versus(best, cand))
