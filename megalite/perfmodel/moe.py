"""Mixture of experts in the estimator: total vs active parameters, per-rank expert memory, all-to-all bytes.

The formulas (parameters of a MoE layer, the all-to-all's bytes, the experts' FLOPs) are
`megalite/moe/costs.py`'s, their one home; here they are applied to a model config and a layout.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megalite.errors import ConfigError
from megalite.mla.costs import MLAShape
from megalite.moe.costs import a2a_bytes_balanced, busiest, busiest_a2a_bytes, expert_flops, expert_params
from megalite.model.spec import ModelSpec, head_dim
from megalite.moe.settings import moe_layers, moe_settings
from megalite.model.params import count_model_params
from megalite.mtp.costs import mtp_flops_per_token, mtp_params
from megalite.perfmodel.estimate import Memory, zero_memory
from megalite.perfmodel.fp8_moe import fp8_lines, moe_fp8_estimate
from megalite.perfmodel.inputs import Layout, Precision


@dataclass(frozen=True)
class MoEParams:
    total: int
    active: int
    experts: int          # routed-expert parameters of the whole model (split over ep)


def moe_param_counts(m: ModelSpec, mla: MLAShape | None = None) -> MoEParams:
    """Total and active parameters of model `m` (resolved; the dense count when it has no MoE), its attention
    MLA's when `mla` is given (megalite/mla/costs.py)."""
    total = count_model_params(m, mla)
    s = moe_settings(m)
    if s is None:
        return MoEParams(total, total, 0)
    one, n = expert_params(m.arch, m.hidden_size, s.ffn_hidden_size), len(moe_layers(m))
    return MoEParams(total, total - n * (s.experts - s.top_k) * one, n * s.experts * one)


@dataclass(frozen=True)
class MoEEstimate:
    params_total: float
    params_active: float
    expert_params_per_rank: float      # routed experts this rank holds: all MoE layers of its stage, E/ep each
    dense_params_per_rank: float       # everything else on the rank (tp-split as the dense model)
    memory: Memory                     # model-state bytes per rank: dense over dp x cp, experts over edp
    ep_bytes_per_step: float           # all-to-all bytes per rank and step (balanced routing)
    a2a_bytes_per_layer: float         # per MoE layer and micro-batch, forward + backward
    imbalance: float | None = None     # a measured max/mean load per expert (metrics.jsonl moe.load_max / load_mean)
    expert_flops_per_step: float = 0.0  # this rank's expert GEMM FLOPs per step (fwd + bwd) under balanced routing
    busiest_factor: float = 1.0        # what `imbalance` implies for the busiest ep rank's expert work (`busiest`)
    ep_bytes_per_step_busiest: float = 0.0  # that rank's all-to-all bytes per step (it sends back all it got)


def moe_estimate(m: ModelSpec, layout: Layout, ep: int, prec: Precision = Precision(),
                 load_max_over_mean: float | None = None) -> MoEEstimate:
    """What the estimator adds for a MoE model config `m` (resolved) at `layout` with `ep` (module doc for the bytes).

    Memory: the routed experts are split over ep and their ZeRO states over edp = dp x cp / ep; the rest
    of the model is as dense (split over tp, states over dp x cp). Experts are replicated over tp (megalite
    does not split an expert over tp), so tp does not divide them. The stage with the most MoE layers."""
    tp, pp, dp, cp, zero, sp = layout.tp, layout.pp, layout.dp, layout.cp, layout.zero, layout.sp
    micro_batch_size, num_microbatches = layout.micro_batch_size, layout.num_microbatches
    counts = moe_param_counts(m)
    s = moe_settings(m)
    if s is None:
        raise ValueError("moe_estimate needs a MoE model (moe.experts > 0)")
    if (dp * cp) % ep or s.experts % ep:
        raise ConfigError(f"ep={ep} must divide dp x cp = {dp * cp} and the {s.experts} experts")
    layers = moe_layers(m)
    per_stage = -(-m.num_layers // pp)  # uneven splits (DeepSeek-V3's 61 layers over 16): the larger stages
    most = max(sum(1 for i in layers if r * per_stage <= i < (r + 1) * per_stage) for r in range(pp))
    one = expert_params(m.arch, m.hidden_size, s.ffn_hidden_size)
    experts_rank = float(most * s.experts // ep * one)
    dense_rank = (counts.total - counts.experts) / (tp * pp)
    edp = dp * cp // ep
    mem_dense = zero_memory(dense_rank, dp * cp, zero, prec)
    mem_exp = zero_memory(experts_rank, edp, zero, prec)
    mem = Memory(*(getattr(mem_dense, k) + getattr(mem_exp, k) for k in ("params", "grads", "master", "optimizer")))
    tokens = micro_batch_size * m.seq_len // cp // (tp if sp else 1)
    per_layer = a2a_bytes_balanced(tokens, s.top_k, s.experts, m.hidden_size, ep, prec.activation)
    f = busiest(load_max_over_mean, ep)
    busiest_layer = busiest_a2a_bytes(tokens, s.top_k, s.experts, m.hidden_size, ep, prec.activation, f)
    n = most * num_microbatches
    return MoEEstimate(counts.total, counts.active, experts_rank, dense_rank, mem, per_layer * n, per_layer,
                       load_max_over_mean, expert_flops(tokens, s.top_k, one) * n, f, busiest_layer * n)


_DIM_FLAGS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "seq_len", "head_dim")  # the model flags tools/estimate.py and tools/plan.py share (config names)


def moe_preset_model(preset: str | None, overrides: Mapping[str, Any] | None = None) -> Any | None:
    """The resolved model config of a config preset with experts (None for a dense or unknown one), with the
    tools' explicit model flags (`overrides`: --num-layers, --seq-len ...; None = not given) applied, as they
    are to the dense sections."""
    from megalite.config import PRESETS, config_from_dict

    if preset is None or preset not in PRESETS or not PRESETS[preset].get("moe"):
        return None
    flags = {k: v for k, v in (overrides or {}).items() if k in _DIM_FLAGS and v is not None}
    return _resolved(config_from_dict({"model": {"preset": preset, **flags}}))


def _resolved(cfg: Any) -> Any:
    from megalite.config import ModelArgs
    from megalite.config.derive import resolve

    r = resolve(cfg, 1)
    m = ModelArgs.from_config(r)
    m.vocab_size = m.vocab_size or 2048
    return m


def moe_model_for(preset: str | None, overrides: Mapping[str, Any], config_argv: Sequence[str]) -> tuple[Any, int]:
    """(the MoE model config to price or None, the config's parallel.ep): from --preset, else from a pretrain
    config (`--config FILE`, `--model.preset tiny-moe`, `--moe.experts 8`, ...), with the model flags
    applied to either."""
    from dataclasses import replace

    from megalite.config import parse_args

    cfg = parse_args(list(config_argv)) if config_argv else None
    ep = cfg.parallel.ep if cfg is not None else 1
    if preset is not None or cfg is None:  # --preset wins over a config's model, as for the dense sections
        return moe_preset_model(preset, overrides), ep
    flags = {k: v for k, v in overrides.items() if k in _DIM_FLAGS and v is not None}
    return (_resolved(replace(cfg, model=replace(cfg.model, **flags))) if cfg.moe.experts else None), ep


def moe_report(layout: Any, prec: Precision, flags: Mapping[str, Any], config_argv: Sequence[str] = (),
               fp8: tuple[str, int] | None = None) -> tuple[dict, list[str]]:
    """tools/estimate.py's MoE section for a model with experts (`moe_model_for`): ({} , []) for a dense one.
    `flags`: the tool's (preset, ep, moe_load_imbalance and the model dims); ep None: the config's parallel.ep
    (1 without one); ep > 1 for a dense model is refused. `fp8` (recipe, min_dim): what runs in FP8, the expert
    GEMMs included (megalite.perfmodel.fp8_moe)."""
    m, config_ep = moe_model_for(flags.get("preset"), flags, config_argv)
    ep, load_imbalance = flags.get("ep") or config_ep, flags.get("moe_load_imbalance")
    if m is None:
        if ep > 1:
            raise ConfigError(f"--ep {ep} needs a mixture-of-experts model (a MoE preset such as tiny-moe or "
                              "mixtral-8x7b, or a config with moe.experts > 0)")
        return {}, []
    from dataclasses import asdict

    est = moe_estimate(m, layout, ep, prec, load_imbalance)
    gb = 1e9
    lines = [f"mixture of experts (ep={ep}, edp={layout.dp * layout.cp // ep}): {est.params_total / 1e9:.3f} B total, "
             f"{est.params_active / 1e9:.3f} B active parameters per token",
             f"  per rank: {est.expert_params_per_rank / 1e9:.3f} B expert + {est.dense_params_per_rank / 1e9:.3f} B "
             f"other parameters; model states {est.memory.model_states / gb:.2f} GB (experts' ZeRO states over edp)",
             f"  all-to-all (dispatch + combine, fwd + bwd, balanced routing): {est.a2a_bytes_per_layer / gb:.4g} GB "
             f"per MoE layer per micro-batch, {est.ep_bytes_per_step / gb:.4g} GB per step per rank ('ep')",
             "  (the sections above count the experts as one dense MLP; these lines replace them for the experts)"]
    if flags.get("mtp_layers"):  # multi-token prediction modules, their blocks MoE as the model builds them
        c = mtp_costs(m, flags["mtp_layers"])
        lines.append(f"  multi-token prediction (D={flags['mtp_layers']}, docs/mtp.md): +{c.params / 1e9:.3f} B total, "
                     f"+{c.active / 1e9:.3f} B active parameters, +{c.flops_per_token / 1e9:.3g} GFLOP per token")
    if flags.get("optimizer") == "muon":
        section, line = _muon_experts(m, layout, ep, flags.get("muon_ns_steps") or 5)
        lines.append(line)
    else:
        section = {}
    if load_imbalance is not None:
        lines.append(f"  measured load max/mean {load_imbalance:.3g}: the busiest ep rank computes up to "
                     f"{est.busiest_factor:.3g}x the balanced expert FLOPs ({est.expert_flops_per_step * est.busiest_factor / 1e12:.4g}"
                     f" vs {est.expert_flops_per_step / 1e12:.4g} TFLOP per step) and sends up to "
                     f"{est.ep_bytes_per_step_busiest / gb:.4g} GB per step ('ep'); every rank waits for it at the combine")
    result: dict = {"moe": {**asdict(est), **section}}
    if fp8 is not None:
        f8 = moe_fp8_estimate(m, layout, ep, fp8[0], fp8[1])
        result["moe"]["fp8"] = f8.to_dict()
        lines += fp8_lines(f8, ep)
    return result, lines


def _muon_experts(m: ModelSpec, layout: Any, ep: int, steps: int) -> tuple[dict, str]:
    """Muon on the experts (`megalite.parallel.param_spec.MatrixStack`): each expert's logical matrices
    orthogonalised on one owner over edp (ZeRO >= 1; every edp rank at ZeRO 0) and by every TP rank alike
    (experts are whole there: no tp bytes); the dp part's bytes bounded as `muon.muon_dp_bytes_bound`."""
    from megalite.perfmodel.muon import muon_dp_bytes_bound, ns_flops

    s = moe_settings(m)
    assert s is not None
    h, f = m.hidden_size, s.ffn_hidden_size
    per_expert = [(f, h), (f, h), (h, f)] if m.arch == "llama" else [(f, h), (h, f)]
    per_stage = -(-m.num_layers // layout.pp)
    most = max(sum(1 for i in moe_layers(m) if r * per_stage <= i < (r + 1) * per_stage) for r in range(layout.pp))
    matrices = most * (s.experts // ep)  # experts on this rank
    edp = layout.dp * layout.cp // ep
    owners = edp if layout.zero >= 1 else 1
    flops = matrices * sum(ns_flops(r, c, steps) for r, c in per_expert) / owners
    elements = matrices * sum(r * c for r, c in per_expert)
    dp_bytes = muon_dp_bytes_bound(elements, 1, owners) if owners > 1 else 0.0
    return ({"muon_experts": {"ns_flops_per_rank": flops, "dp_bytes_per_rank_bound": dp_bytes}},
            f"  muon on the experts: Newton-Schulz {flops:.4e} FLOPs per step per rank, 'muon' bytes at most "
            f"{dp_bytes / 1e9:.4g} GB over edp (experts are whole on every TP rank: none over tp)")


@dataclass(frozen=True)
class MTPCosts:
    """The multi-token prediction modules in the MoE-aware counts (the trainer's MFU, this tool's MoE section)."""

    params: int            # the modules' own parameters
    active: int            # those a token uses
    flops_per_token: float  # training FLOPs per token of the modules and their logits
    flops_per_token_causal: float  # the same with the causal-halved attention count


def mtp_costs(m: Any, depth: int) -> MTPCosts:
    """The D multi-token prediction modules of model config `m` (resolved; the formulas are `megalite.mtp.costs`'):
    their blocks are global layers num_layers .. + D - 1, so a MoE model's MTP block is MoE where
    `moe_first_dense` / `moe_every` say so, as the model builds it."""
    if depth <= 0:
        return MTPCosts(0, 0, 0.0, 0.0)
    more = copy.copy(m)
    more.num_layers = m.num_layers + depth
    with_blocks, base = moe_param_counts(more), moe_param_counts(m)
    blocks, blocks_active = with_blocks.total - base.total, with_blocks.active - base.active
    h = m.hidden_size
    attn = m.num_heads * head_dim(m)
    total = mtp_params(depth, h, blocks // depth)
    active = mtp_params(depth, h, blocks_active // depth)
    flops = [mtp_flops_per_token(depth, h, m.vocab_size, blocks_active // depth, attn, m.seq_len, causal)
             for causal in (False, True)]
    return MTPCosts(total, active, *flops)
