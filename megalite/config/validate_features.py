"""The rules of the features that came after the core layout rules: context-parallel modes, FP8,
mixture of experts and Muon, one function each, called by `validate.validate` with the others (one line per problem)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING


from megalite.fp8 import checks, costs
from megalite.moe.settings import MoESettings, moe_layers

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


def fp8_problems(cfg: Config, device_type: str) -> list[str]:
    """train.fp8 (megalite/fp8/checks.py): the torch, device and dtype it runs with; a block recipe's layout."""
    tr, m, p = cfg.train, cfg.model, cfg.parallel
    if tr.fp8 == "none":
        return []
    hd = m.head_dim or m.hidden_size // max(m.num_heads, 1)
    gated, q, kv = m.arch == "llama", m.num_heads * hd, (m.num_kv_heads or m.num_heads) * hd
    dense = costs.block_gemms(m.hidden_size, q, kv, m.ffn_hidden_size, gated, tr.fp8_min_dim)
    gemms = [g for g in dense if g.name.startswith("attn.")]
    s = MoESettings.from_model(m)
    if s is None or len(moe_layers(m)) < m.num_layers:  # a dense layer's MLP
        gemms += [g for g in dense if g.name.startswith("mlp.")]
    if s is not None and s.shared:
        gemms += costs.shared_expert_gemms(m.hidden_size, s.shared * s.shared_ffn, gated, tr.fp8_min_dim)
    return (checks.fp8_problems(tr.fp8, tr.fp8_min_dim, tr.dtype, device_type)
            + checks.block_layout_problems(tr.fp8, gemms, p.tp, p.cp, m.seq_len))


def moe_problems(cfg: Config) -> list[str]:
    """Mixture-of-experts fields and expert parallelism (megalite/moe, docs/moe.md)."""
    m, p = cfg.model, cfg.parallel
    out: list[str] = []
    if m.moe_experts < 0:
        out.append(f"model.moe_experts must be >= 0 (0 = dense), got {m.moe_experts}")
    if p.ep < 1:
        out.append(f"parallel.ep must be >= 1, got {p.ep}")
        return out
    if m.moe_experts <= 0:
        if p.ep > 1:
            out.append(f"parallel.ep={p.ep} needs a mixture-of-experts model: set model.moe_experts > 0 or ep=1")
        return out
    if m.moe_router not in ("mixtral", "qwen3", "deepseek"):
        out.append(f"model.moe_router: {m.moe_router!r} is not one of mixtral, qwen3, deepseek")
    if not 1 <= m.moe_top_k <= m.moe_experts:
        out.append(f"model.moe_top_k {m.moe_top_k} must be between 1 and model.moe_experts {m.moe_experts}")
    if m.moe_capacity_factor is not None and not m.moe_capacity_factor > 0:
        out.append(f"model.moe_capacity_factor must be > 0 (or unset for dropless), got {m.moe_capacity_factor}")
    for key in ("moe_ffn_hidden_size", "moe_shared_experts", "moe_shared_ffn_hidden_size", "moe_first_dense"):
        if getattr(m, key) < 0:
            out.append(f"model.{key} must be >= 0, got {getattr(m, key)}")
    if m.moe_every < 1:
        out.append(f"model.moe_every must be >= 1, got {m.moe_every}")
    elif m.num_layers > 0 and m.moe_first_dense >= m.num_layers:  # would train a dense model, silently
        out.append(f"model.moe_first_dense {m.moe_first_dense} leaves no MoE layer among the {m.num_layers} layers: "
                   "lower it, or set model.moe_experts=0 for a dense model")
    if not m.moe_route_scale > 0:
        out.append(f"model.moe_route_scale must be > 0 (it multiplies the routing weights), got {m.moe_route_scale}")
    for key in ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss", "moe_bias_rate"):
        if not getattr(m, key) >= 0:
            out.append(f"model.{key} must be >= 0, got {getattr(m, key)}")
    if m.moe_groups < 1 or m.moe_experts % m.moe_groups:
        out.append(f"model.moe_groups {m.moe_groups} must divide model.moe_experts {m.moe_experts}")
    elif m.moe_groups > 1 and (not 1 <= m.moe_group_top_k <= m.moe_groups  # groups 1: group routing off
                               or m.moe_top_k > m.moe_group_top_k * (m.moe_experts // m.moe_groups)):
        out.append(f"model.moe_group_top_k {m.moe_group_top_k} must be in 1..moe_groups {m.moe_groups} and leave "
                   f"at least moe_top_k {m.moe_top_k} experts")
    if m.moe_experts % p.ep:
        out.append(f"model.moe_experts {m.moe_experts} is not divisible by parallel.ep {p.ep}: each expert-parallel "
                   "rank needs an equal share of the experts")
    if p.dp >= 1 and p.cp >= 1 and (p.dp * p.cp) % p.ep:
        out.append(f"parallel.ep {p.ep} does not divide dp x cp = {p.dp} x {p.cp} = {p.dp * p.cp}: expert "
                   "parallelism takes its ranks from the data- and context-parallel ones")
    shared = m.moe_shared_experts * (m.moe_shared_ffn_hidden_size or m.moe_ffn_hidden_size or m.ffn_hidden_size)
    if shared and shared % p.tp:
        out.append(f"the shared experts' width {shared} is not divisible by parallel.tp {p.tp}")
    return out


def muon_problems(cfg: Config) -> list[str]:
    """train.optimizer=muon's fields (megalite/optim/muon.py, docs/muon.md)."""
    tr = cfg.train
    if tr.optimizer != "muon":
        return []
    out: list[str] = []
    if not 0 <= tr.muon_momentum < 1:
        out.append(f"train.muon_momentum must be in [0, 1), got {tr.muon_momentum}")
    if tr.muon_ns_steps < 1:
        out.append(f"train.muon_ns_steps must be >= 1 (Newton-Schulz steps), got {tr.muon_ns_steps}")
    if not tr.muon_rms > 0:
        out.append(f"train.muon_rms must be > 0, got {tr.muon_rms}")
    return out


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
    if m.compile_backend == "inductor" and device_type == "cpu":
        from megalite.model.compile import cpu_compiler

        found, searched = cpu_compiler()
        if found is None:
            out.append(f"model.compile with inductor on CPU needs a C++ compiler and none of {searched} is an "
                       "executable (on PATH, or the path in CXX): install one (apt-get install g++), point CXX at "
                       "it, or set model.compile_backend=aot_eager")
    return out
