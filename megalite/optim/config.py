"""The `[optimizer]` and `[muon]` config sections (docs/muon.md) and their checks. Torch-free, so
`megalite.config` reads them cheaply (this package's `__init__` imports its torch modules lazily for that).

The learning rate, its schedule and the gradient clip stay in `[train]`: every optimizer shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.section import doc_field as _f

OPTIMIZERS = ("adamw", "muon")  # `optimizer.name`
# Newton-Schulz's quintic iteration orthogonalises in ~5 steps; each step is 3 matmuls per weight, all inside the
# optimizer step (a SIGTERM waits for it): 1e9 steps would never finish step 1. 100 is far past any use.
MAX_NS_STEPS = 100
MAX_RMS = 10.0  # the update's RMS per unit lr (0.2 matches AdamW's); beyond 10 the first update diverges
MAX_ADAM_EPS = 1.0  # an epsilon guards Adam's division; >= 1 silently turns Adam into a tiny-step SGD


@dataclass
class OptimizerConfig:
    name: str = _f("adamw", "adamw | muon (Muon for the blocks' 2-D weights, AdamW for the rest; docs/muon.md)")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases); Muon's too")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")

    @property
    def betas(self) -> tuple[float, float]:
        return self.beta1, self.beta2


@dataclass
class MuonConfig:
    """Muon's hyper-parameters (the learning rate comes per step; weight decay is `optimizer.weight_decay`)."""

    momentum: float = _f(0.95, "Muon momentum mu (M = mu M + G)")
    nesterov: bool = _f(True, "Muon: orthogonalise G + mu M (Nesterov) instead of M")
    ns_steps: int = _f(5, "Muon: Newton-Schulz steps (quintic, coefficients 3.4445, -4.7750, 2.0315)")
    rms: float = _f(0.2, "Muon: update RMS to match (Liu et al. 2025): lr x muon.rms x sqrt(max(rows, cols))")


def problems(opt: OptimizerConfig, muon: MuonConfig) -> list[str]:
    """`[optimizer]` and, when it names Muon, `[muon]`, one line per problem."""
    out: list[str] = []
    if opt.name not in OPTIMIZERS:
        out.append(f"optimizer.name: {opt.name!r} is not one of {', '.join(OPTIMIZERS)}")
    if opt.weight_decay < 0:
        out.append(f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}")
    for key, beta in (("beta1", opt.beta1), ("beta2", opt.beta2)):
        if not 0 <= beta < 1:
            out.append(f"optimizer.{key} must be in [0, 1), got {beta}")
    if not 0 < opt.adam_eps <= MAX_ADAM_EPS:
        out.append(f"optimizer.adam_eps must be in (0, {MAX_ADAM_EPS:g}] (it guards a division), got {opt.adam_eps}")
    if opt.name != "muon":
        return out
    if not 0 <= muon.momentum < 1:
        out.append(f"muon.momentum must be in [0, 1), got {muon.momentum}")
    if not 1 <= muon.ns_steps <= MAX_NS_STEPS:
        out.append(f"muon.ns_steps must be in 1..{MAX_NS_STEPS} (Newton-Schulz steps; 5 orthogonalise), "
                   f"got {muon.ns_steps}")
    if not 0 < muon.rms <= MAX_RMS:
        out.append(f"muon.rms must be in (0, {MAX_RMS:g}], got {muon.rms}")
    return out
