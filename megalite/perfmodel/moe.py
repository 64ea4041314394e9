"""Mixture of experts in the estimator: total vs active parameters, per-rank expert memory, all-to-all bytes.

Parameters of a MoE layer replace the dense MLP's (3 h f SwiGLU, 2 h f + biases-free GeLU experts) by
  router      E h
  routed      E x (3 h F) (llama) or E x (2 h F) (gpt2 experts have no biases)
  shared      3 h (n_s F_s) (llama) or 2 h (n_s F_s) + n_s F_s + h (a gpt2 MLP with biases)
and a token uses the router, its k experts and the shared ones: active = total - (E - k) x expert.

Expert parallelism moves, per MoE layer and micro-batch, on each rank (the `CommCounter` convention for
all_to_all: the bytes sent to the other ep ranks):
  counts     (ep - 1) x E/ep x 8 bytes (how many rows go to each expert; int64)
  dispatch   rows sent off-rank x h x b forward, the same rows' gradients back in the combine's backward
  combine    rows received from other ranks x h x b forward, and again in the dispatch's backward
so with balanced routing (each of the T k assignments equally likely on any ep rank) a rank sends
T k (ep - 1)/ep rows each way: 4 x T k (ep - 1)/ep x h x b per layer per micro-batch, plus the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.errors import ConfigError
from megalite.moe.settings import MoESettings, moe_layers
from megalite.perfmodel.estimate import Memory, count_params, zero_memory
from megalite.perfmodel.fp8_moe import fp8_lines, moe_fp8_estimate
from megalite.perfmodel.inputs import Precision


@dataclass(frozen=True)
class MoEParams:
    total: int
    active: int
    experts: int          # routed-expert parameters of the whole model (split over ep)


def expert_params(arch: str, hidden: int, ffn: int) -> int:
    return (3 if arch == "llama" else 2) * hidden * ffn


def moe_param_counts(m: Any) -> MoEParams:
    """Total and active parameters of model config `m` (resolved; the dense count when it has no MoE)."""
    tie = bool(m.tie_embeddings)
    dense = count_params(m.arch, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size,
                         m.vocab_size, m.seq_len, tie)
    s = MoESettings.from_model(m)
    if s is None:
        return MoEParams(dense, dense, 0)
    n = len(moe_layers(m))
    h = m.hidden_size
    dense_mlp = expert_params(m.arch, h, m.ffn_hidden_size) + (m.ffn_hidden_size + h if m.arch == "gpt2" else 0)
    one = expert_params(m.arch, h, s.ffn)
    shared = 0
    if s.shared:
        fs = s.shared * s.shared_ffn
        shared = expert_params(m.arch, h, fs) + (fs + h if m.arch == "gpt2" else 0)
    per_layer = h * s.experts + s.experts * one + shared
    total = dense + n * (per_layer - dense_mlp)
    return MoEParams(total, total - n * (s.experts - s.top_k) * one, n * s.experts * one)


def a2a_bytes_balanced(tokens: int, top_k: int, experts: int, hidden: int, ep: int, bytes_per: int) -> float:
    """One rank's all-to-all bytes for one MoE layer and micro-batch of `tokens` local tokens, forward and
    backward, under balanced routing (module doc)."""
    if ep == 1:
        return 0.0
    rows = tokens * top_k * (ep - 1) / ep
    return 4 * rows * hidden * bytes_per + (ep - 1) * (experts // ep) * 8


def a2a_bytes_measured(off_rank_rows: int, calls: int, ep: int, experts: int, hidden: int, bytes_per: int,
                       forward_passes: int = 1) -> int:
    """The same from a run's measured routing: `off_rank_rows` = rows this rank sent to plus received from
    the other ep ranks over `calls` layer-micro-batches (metrics.jsonl moe.a2a_rows / a2a_calls). Dispatch
    and combine each move those rows forward (forward_passes times: 2 with full recompute, where the
    forward's exchange runs again in the backward) and once backward, plus the counts per forward."""
    if ep == 1:
        return 0
    counts = (ep - 1) * (experts // ep) * 8
    return (forward_passes + 1) * off_rank_rows * hidden * bytes_per + forward_passes * calls * counts


@dataclass(frozen=True)
class MoEEstimate:
    params_total: float
    params_active: float
    expert_params_per_rank: float      # routed experts this rank holds: all MoE layers of its stage, E/ep each
    dense_params_per_rank: float       # everything else on the rank (tp-split as the dense model)
    memory: Memory                     # model-state bytes per rank: dense over dp x cp, experts over edp
    ep_bytes_per_step: float           # all-to-all bytes per rank and step (balanced routing)
    a2a_bytes_per_layer: float         # per MoE layer and micro-batch, forward + backward
    imbalance: float | None = None     # a measured max/mean load: the busiest rank's share of expert compute


def moe_estimate(m: Any, tp: int, pp: int, dp: int, cp: int, ep: int, zero: int, micro_batch_size: int,
                 num_microbatches: int, sp: bool, prec: Precision = Precision(),
                 load_max_over_mean: float | None = None) -> MoEEstimate:
    """What the estimator adds for a MoE model config `m` (resolved) at a layout (module doc for the bytes).

    Memory: the routed experts are split over ep and their ZeRO states over edp = dp x cp / ep; the rest
    of the model is as dense (split over tp, states over dp x cp). Experts are replicated over tp (megalite
    does not split an expert over tp), so tp does not divide them. The stage with the most MoE layers."""
    counts = moe_param_counts(m)
    s = MoESettings.from_model(m)
    if s is None:
        raise ValueError("moe_estimate needs a MoE model (moe_experts > 0)")
    if (dp * cp) % ep or s.experts % ep:
        raise ConfigError(f"ep={ep} must divide dp x cp = {dp * cp} and the {s.experts} experts")
    layers = moe_layers(m)
    per_stage = -(-m.num_layers // pp)  # uneven splits (DeepSeek-V3's 61 layers over 16): the larger stages
    most = max(sum(1 for i in layers if r * per_stage <= i < (r + 1) * per_stage) for r in range(pp))
    one = expert_params(m.arch, m.hidden_size, s.ffn)
    experts_rank = float(most * s.experts // ep * one)
    dense_rank = (counts.total - counts.experts) / (tp * pp)
    edp = dp * cp // ep
    mem_dense = zero_memory(dense_rank, dp * cp, zero, prec)
    mem_exp = zero_memory(experts_rank, edp, zero, prec)
    mem = Memory(*(getattr(mem_dense, k) + getattr(mem_exp, k) for k in ("params", "grads", "master", "optimizer")))
    tokens = micro_batch_size * m.seq_len // cp // (tp if sp else 1)
    per_layer = a2a_bytes_balanced(tokens, s.top_k, s.experts, m.hidden_size, ep, prec.activation)
    return MoEEstimate(counts.total, counts.active, experts_rank, dense_rank, mem,
                       per_layer * most * num_microbatches, per_layer, load_max_over_mean)


def moe_preset_model(preset: str | None, seq_len: int | None = None) -> Any | None:
    """The resolved model config of a config preset with experts (None for a dense or unknown one)."""
    from dataclasses import asdict

    from megalite.config import PRESETS, ModelConfig
    from megalite.config.derive import resolve
    from megalite.config.schema import Config

    if preset is None or preset not in PRESETS or not PRESETS[preset].get("moe_experts"):
        return None
    values = {**asdict(ModelConfig()), **PRESETS[preset], **({"seq_len": seq_len} if seq_len else {})}
    m = resolve(Config(model=ModelConfig(**values)), 1).model
    m.vocab_size = m.vocab_size or 2048
    return m


def moe_report(preset: str | None, layout: Any, ep: int, prec: Precision,
               fp8: tuple[str, int] | None = None) -> tuple[dict, list[str]]:
    """tools/estimate.py's MoE section for a config preset with experts: ({} , []) for a dense one; `fp8`
    (recipe, min_dim): what runs in FP8, the expert GEMMs included (megalite.perfmodel.fp8_moe)."""
    m = moe_preset_model(preset)
    if m is None:
        return {}, []
    from dataclasses import asdict

    mb = layout.num_microbatches
    est = moe_estimate(m, layout.tp, layout.pp, layout.dp, layout.cp, ep, layout.zero, layout.micro_batch_size, mb,
                       layout.sp, prec)
    gb = 1e9
    lines = [f"mixture of experts (ep={ep}, edp={layout.dp * layout.cp // ep}): {est.params_total / 1e9:.3f} B total, "
             f"{est.params_active / 1e9:.3f} B active parameters per token",
             f"  per rank: {est.expert_params_per_rank / 1e9:.3f} B expert + {est.dense_params_per_rank / 1e9:.3f} B "
             f"other parameters; model states {est.memory.model_states / gb:.2f} GB (experts' ZeRO states over edp)",
             f"  all-to-all (dispatch + combine, fwd + bwd, balanced routing): {est.a2a_bytes_per_layer / gb:.4g} GB "
             f"per MoE layer per micro-batch, {est.ep_bytes_per_step / gb:.4g} GB per step per rank ('ep')",
             "  (the sections above count the experts as one dense MLP; these lines replace them for the experts)"]
    section: dict = {"moe": asdict(est)}
    if fp8 is not None:
        f8 = moe_fp8_estimate(m, layout, ep, fp8[0], fp8[1])
        section["moe"]["fp8"] = f8.to_dict()
        lines += fp8_lines(f8, ep)
    return section, lines
