"""Config validation, shapes against the parallel layout: Megatron-core's divisibility rules, the batch
arithmetic, the pipeline schedules', the context-parallel modes' and sizes no device can hold. One phrase per
problem; `validate.py` collects them.
"""

from __future__ import annotations

import dataclasses
import math

from megalite.config.schema import Config, ModelArgs
from megalite.config.values import value_of
from megalite.model.params import count_model_params


# 16 TiB: more memory than any single accelerator or host offers (DeepSeek-V3's 671 B parameters, 2.4 TiB in fp32, still
# validate on one rank for the tools; the check before step 1 prices a real run's memory).
_MAX_RANK_BYTES = 2 ** 44


def size_problems(cfg: Config, experts_valid: bool = True) -> list[str]:
    """Sizes no run can hold: odd RoPE head dims, and weights alone beyond any device's memory (refused
    with the numbers instead of allocating until the machine swaps or the OOM killer steps in)."""
    m, p = cfg.model, cfg.parallel
    out: list[str] = []
    if min(m.num_heads, m.hidden_size, p.tp, p.pp) < 1 or m.hidden_size % m.num_heads:
        return out  # reported elsewhere
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    if m.head_dim < 0 or (m.head_dim and m.arch != "llama"):
        out.append(f"model.head_dim {m.head_dim} must be 0 (hidden_size / num_heads) or, with model.arch=llama, > 0")
    elif m.arch == "llama" and head_dim % 2 and not cfg.mla.enabled:  # MLA rotates mla.qk_rope_head_dim
        out.append(f"model.hidden_size {m.hidden_size} / num_heads {m.num_heads} = head dim {head_dim} is odd; "
                   "rotary embeddings rotate pairs of dims: choose an even head dim")
    # Experts and shared experts included (their fields once they are valid: the [moe] checks report the rest).
    moe = cfg.moe if experts_valid else dataclasses.replace(cfg.moe, experts=0)
    n = count_model_params(ModelArgs.of(m, moe), cfg.mla if cfg.mla.enabled else None)
    weights = 4 * n / (p.tp * p.pp * max(1, p.ep))  # fp32 weights alone, the least a rank must hold
    if weights > _MAX_RANK_BYTES:
        out.append(f"the model has {n:.3g} parameters: its fp32 weights alone are {weights / 2**40:.3g} TiB per rank "
                   f"(tp {p.tp} x pp {p.pp} x ep {p.ep}), beyond any device's memory ({_MAX_RANK_BYTES / 2**40:g} "
                   "TiB): choose smaller model.* dims (moe.* widths and counts included) or more tp/pp/ep")
    return out


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """Shapes against the parallel layout (Megatron-core's rules) and the batch arithmetic."""
    m, p = cfg.model, cfg.parallel
    out: list[str] = []
    from megalite.dp.zero3 import zero3_problems  # the one place ZeRO-3's limits live (torch: imported late)

    out += zero3_problems(p.zero, p.vpp, p.pp > 1 and bool(m.tie_embeddings))
    if m.num_heads >= 1 and m.hidden_size % m.num_heads:
        out.append(f"model.hidden_size {m.hidden_size} is not divisible by model.num_heads {m.num_heads}: "
                   f"make hidden_size a multiple of num_heads")
    if m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
        out.append(f"model.num_heads {m.num_heads} is not divisible by model.num_kv_heads {m.num_kv_heads}: "
                   f"each kv head must serve a whole group of query heads")
    if min(p.tp, p.cp, p.pp, p.dp, p.vpp) < 1:
        return out  # reported by value_problems; the arithmetic below would divide by zero
    model_parallel = p.tp * p.cp * p.pp
    if world_size != model_parallel * p.dp:
        names, sizes = ("tp*cp*pp", f"tp {p.tp} x cp {p.cp}") if p.cp > 1 else ("tp*pp", f"tp {p.tp}")
        fix = (f"set parallel.dp={world_size // model_parallel} (or 0 to derive it)"
               if world_size % model_parallel == 0 else f"launch a multiple of {names} = {model_parallel} processes")
        out.append(f"world_size {world_size} != {sizes} x pp {p.pp} x dp {p.dp} = {model_parallel * p.dp}: "
                   f"{fix} or change {names.replace('*', '/')}")
    out += _context_problems(cfg)
    out += cp_mode_problems(cfg)
    stages = p.pp * p.vpp
    if not p.pp_layers:
        if m.num_layers % stages:
            out.append(f"model.num_layers {m.num_layers} is not divisible by pp x vpp = {p.pp} x {p.vpp} = "
                       f"{stages}: change num_layers or give parallel.pp_layers (layers per stage)")
    else:
        if len(p.pp_layers) != stages:
            out.append(f"parallel.pp_layers has {len(p.pp_layers)} entries but pp x vpp = {stages} "
                       f"stages need one each")
        if any(n < 1 for n in p.pp_layers):
            out.append(f"parallel.pp_layers {p.pp_layers}: every stage needs at least 1 layer")
        if sum(p.pp_layers) != m.num_layers:
            out.append(f"parallel.pp_layers {p.pp_layers} sums to {sum(p.pp_layers)} but model.num_layers "
                       f"is {m.num_layers}")
    for key in ("model.num_heads", "model.num_kv_heads", "model.ffn_hidden_size"):
        if value_of(cfg, key) % p.tp:
            out.append(f"{key} {value_of(cfg, key)} is not divisible by parallel.tp {p.tp}: "
                       f"each tensor-parallel rank needs an equal share")
    if p.sp and p.tp == 1:
        out.append("parallel.sp needs parallel.tp > 1 (it shards activations over the tp ranks): "
                   "set tp >= 2 or sp=false")
    elif p.sp and m.seq_len % p.tp:
        out.append(f"model.seq_len {m.seq_len} is not divisible by parallel.tp {p.tp}, which "
                   f"sequence parallelism needs: change seq_len or tp")
    out += _batch_problems(cfg)
    return out


def _context_problems(cfg: Config) -> list[str]:
    """Context parallelism: the zigzag split needs 2*cp equal chunks of every sequence, and SP cuts each
    rank's S/cp tokens over tp. It composes with tp (+sp), pp (every schedule), dp and ZeRO 0-3 (sharded over
    dp x cp); the attention runs the ring in torch block math with either kernel backend."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return []
    out = []
    if m.seq_len % (2 * p.cp):
        out.append(f"model.seq_len {m.seq_len} is not divisible by 2 x parallel.cp = {2 * p.cp}: context "
                   f"parallelism cuts each sequence into 2*cp chunks (rank r holds chunks r and 2cp-1-r, so every "
                   f"rank does the same causal attention work); use a multiple of {2 * p.cp}")
    if p.sp and (m.seq_len // p.cp) % p.tp:
        out.append(f"model.seq_len / cp = {m.seq_len // p.cp} tokens per cp rank is not divisible by parallel.tp "
                   f"{p.tp}, which sequence parallelism needs: change seq_len, cp or tp")
    return out


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


def _batch_problems(cfg: Config) -> list[str]:
    """Global batch vs micro-batch x dp, and micro-batches vs pipeline stages (the bubble)."""
    p, t = cfg.parallel, cfg.train
    out: list[str] = []
    if min(t.micro_batch_size, t.global_batch_size) < 1:
        return out
    per_step = t.micro_batch_size * p.dp
    m_count = t.global_batch_size // per_step
    if t.global_batch_size % per_step:
        out.append(f"train.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
                   f"{t.micro_batch_size} x dp {p.dp} = {per_step}: use a multiple of {per_step}, e.g. "
                   f"{max(1, m_count) * per_step}")
    if p.pp > 1 and m_count < p.pp:
        out.append(f"only M={m_count} micro-batches per step for pp={p.pp} pipeline stages "
                   f"(M = global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} "
                   f"x dp {p.dp})): the pipeline would idle most of the time; set train.global_batch_size "
                   f">= {per_step * p.pp} (or lower micro_batch_size)")
    from megalite.pipeline.schedules import CHUNKS, layout_problems  # lazily: megalite.config stays torch-free

    if p.schedule in CHUNKS:  # an unknown name is reported with the other choices
        out += layout_problems(p.schedule, p.pp, p.vpp)
    out += _zero_bubble_problems(cfg)
    if p.schedule == "interleaved":
        if p.pp > 1 and m_count % p.pp:
            out.append(f"parallel.schedule=interleaved needs M={m_count} micro-batches per step to be a "
                       f"multiple of pp={p.pp}: set train.global_batch_size to a multiple of "
                       f"{per_step * p.pp}")
    return out


def _zero_bubble_problems(cfg: Config) -> list[str]:
    """ZB-V (Qi et al. 2024) beyond its layout rules (`pipeline.schedules.layout_problems`): tied embeddings."""
    from megalite.pipeline.schedules import V_SHAPED

    p, m = cfg.parallel, cfg.model
    out: list[str] = []
    if p.schedule in V_SHAPED:
        if m.tie_embeddings and p.pp > 1:
            out.append("parallel.schedule=zbv puts the embedding and the head on the same rank, which tied "
                       "embeddings do not support yet: set model.tie_embeddings=false or use zb-h1")
    return out
