"""The rules of the features that came after the core layout rules: context-parallel modes and torch.compile,
one function each, called by `validate.validate` with the others (one line per problem)."""

from __future__ import annotations

import math
import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.schema import Config


def cp_mode_problems(cfg: Config) -> list[str]:
    """The cp mode's own needs (megalite/context/options.py): a2a gives each cp rank 1/cp of the heads, hybrid
    each rank of an all-to-all group of cp_a2a ranks 1/cp_a2a of them, and cp_a2a must divide cp."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1 or p.cp_mode not in ("a2a", "hybrid") or min(p.tp, m.num_heads, m.num_kv_heads) < 1:
        return []
    if p.cp_mode == "hybrid" and (p.cp_a2a < 1 or p.cp % p.cp_a2a):
        return [f"parallel.cp_a2a = {p.cp_a2a} must be >= 1 and divide parallel.cp = {p.cp} (cp_mode=hybrid: "
                f"cp = all-to-all groups of cp_a2a ranks x a ring of cp / cp_a2a)"]
    degree, name = (p.cp, "cp") if p.cp_mode == "a2a" else (p.cp_a2a, "cp_a2a")
    heads, kv = m.num_heads // p.tp, m.num_kv_heads // p.tp
    if heads % degree == 0 and kv % degree == 0:
        return []
    fit = math.gcd(heads, kv)
    other = f", or a {name} dividing {fit}" if fit > 1 else ""
    return [f"parallel.cp_mode={p.cp_mode} splits each tp rank's {heads} query and {kv} kv heads (num_heads "
            f"{m.num_heads}, num_kv_heads {m.num_kv_heads} over tp {p.tp}) into {name} = {degree} equal groups: both "
            f"must be divisible by {name}; use cp_mode=ring or allgather{other}"]


def compile_problems(cfg: Config, device_type: str) -> list[str]:
    """model.compile (megalite/model/compile.py): the backend, what it needs here, the schedules it refuses."""
    from megalite.model.compile import BACKENDS
    from megalite.pipeline.schedules import ZERO_BUBBLE

    m = cfg.model
    if m.compile_backend not in BACKENDS:
        return [f"model.compile_backend={m.compile_backend!r}: use one of {', '.join(BACKENDS)}"]
    if not m.compile:
        return []
    out: list[str] = []
    if cfg.parallel.schedule in ZERO_BUBBLE:
        # Compiled blocks compute each linear's weight gradient inside the graph's backward (the gradient sync's
        # fold, which would defer it to W, cannot be traced): a split backward would have no W left to move.
        out.append(f"model.compile with parallel.schedule={cfg.parallel.schedule}: the compiled blocks compute "
                   "their weight gradients in B, so there is nothing to defer to W: use 1f1b or interleaved")
    if m.compile_backend == "inductor" and device_type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++")):
        out.append("model.compile with inductor on CPU needs a C++ compiler and g++ is not on PATH (nor CXX set): "
                   "install one (apt-get install g++) or set model.compile_backend=aot_eager")
    return out
