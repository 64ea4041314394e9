"""The `[optimizer]` and `[muon]` config sections (docs/muon.md) and their checks. Torch-free, so
`megalite.config` reads them cheaply (this package's `__init__` imports its torch modules lazily for that).

The learning rate, its schedule and the gradient clip stay in `[train]`: every optimizer shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.section import doc_field as _f

OPTIMIZERS = ("adamw", "muon")  # `optimizer.name`


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
    if not opt.adam_eps > 0:
        out.append(f"optimizer.adam_eps must be > 0, got {opt.adam_eps}")
    if opt.name != "muon":
        return out
    if not 0 <= muon.momentum < 1:
        out.append(f"muon.momentum must be in [0, 1), got {muon.momentum}")
    if muon.ns_steps < 1:
        out.append(f"muon.ns_steps must be >= 1 (Newton-Schulz steps), got {muon.ns_steps}")
    if not muon.rms > 0:
        out.append(f"muon.rms must be > 0, got {muon.rms}")
    return out
