"""The estimator and planner price linear_attention (Gated DeltaNet) layers as what they compute
(megalite/perfmodel/mixers.py, the formulas of megalite/recurrent/costs.py): the FLOPs of a tiny hybrid model equal
torch's FLOP counter over its forward, its parameters the built model's, a linear layer's saved tensors autograd's,
the partition over pipeline stages the run's; and a Qwen3.5-like model is priced below the same model with every
layer full attention where the sequence is long (FLOPs, activations, the generation cache, the cp bytes, the
planner's best step)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megalite.config.layers import balanced_pp_layers
from megalite.config.schema import Config, ModelArgs
from megalite.model.gpt import GPT
from megalite.model.pattern import LINEAR_CHUNK
from megalite.parallel.state import ParallelState
from megalite.perfmodel.config_inputs import presets, spec_dims
from megalite.perfmodel.estimate import GB, Hardware, Layout, ModelDims, Precision, estimate, stage_params
from megalite.perfmodel.flops import flops_per_token
from megalite.perfmodel.mixers import linear_cache_bytes, recurrent_dims, stage_layers
from megalite.perfmodel.plan import Cluster, make_plan
from megalite.perfmodel.saved_bytes import layer_activation_bytes
from megalite.recurrent.costs import triangular_solve_flops
from tests.layer_pattern_utils import hybrid_cfg

H100 = Hardware(peak_flops=989e12, inter_bytes_per_s=25 * GB, intra_bytes_per_s=450 * GB)


def _tiny() -> SimpleNamespace:
    # no output gate: the cost model's attention is q/k/v/o (ModelDims carries no gate); vocabulary a multiple of 4
    # (make_vocab_divisible_by): the head's matmul is V x h unpadded
    return hybrid_cfg(attn_output_gate="none", vocab_size=64)


def test_hybrid_forward_flops_equal_torch_count() -> None:
    """The estimator's forward FLOPs (hardware count / 3) of a 3 linear : 1 full model equal torch's FLOP counter
    over the model's forward (every linear, the chunked recurrence's matmuls, the attention's S x S products in full,
    as the estimator's full count prices them, the head) plus
    what torch does not count: the triangular solves and the depthwise conv (elementwise multiply-adds here)."""
    cfg = _tiny()
    dims = spec_dims(cfg)
    assert dims.linear_layers == (0, 1, 2)
    b, s = 2, cfg.seq_len
    model = GPT(cfg, ParallelState(), seed=0)
    # SDPA's math kernel: its matmuls are what the counter sees (the CPU's fused kernel has no FLOP formula)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, cfg.vocab_size, (b, s)))
    d = recurrent_dims(dims)
    assert d is not None
    uncounted = 3 * (triangular_solve_flops(d, b, s, LINEAR_CHUNK) + b * s * 2 * d.conv_channels * d.conv_kernel)
    predicted = b * s * flops_per_token(dims, 0, "none")[1] / 3
    assert counter.get_total_flops() + uncounted == pytest.approx(predicted, rel=1e-12)  # float sum of integers


def test_hybrid_parameters_equal_the_built_model() -> None:
    cfg = _tiny()
    built = sum(p.numel() for p in GPT(cfg, ParallelState(), seed=0).parameters())
    assert stage_params(spec_dims(cfg), 1, 1, 0).total == built


def test_pipeline_stages_are_the_runs() -> None:
    """At a long sequence a full layer costs several linear ones: pp 2 puts the three linear layers on one stage and
    the full layer alone on the other, as the run's partition does (config.layers.balanced_pp_layers)."""
    cfg = Config()
    for k, v in vars(_tiny()).items():
        if hasattr(cfg.model, k) and k not in ("moe", "mla", "mtp"):
            setattr(cfg.model, k, v)
    cfg.model.seq_len, cfg.parallel.pp = 8192, 2
    dims = spec_dims(ModelArgs.of(cfg.model, cfg.moe, cfg.mla, cfg.mtp))
    assert [len(stage_layers(dims, 2, r)) for r in range(2)] == balanced_pp_layers(cfg) == [3, 1]


def test_linear_layer_saved_bytes_equal_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """What one linear block saves for its backward on the Triton kernel path (its interpreter here), fp32, one
    process: every saved tensor's storage once, the model's parameters left out (tests/test_memory_terms.py's count)."""
    from megalite.model import linear_mixer

    config = linear_mixer.delta_layer_config
    monkeypatch.setattr(linear_mixer, "delta_layer_config", lambda c, o: replace(config(c, o), backend="triton"))
    cfg = hybrid_cfg(seq_len=64)
    model = GPT(cfg, ParallelState(), seed=0)
    owned = {t.untyped_storage().data_ptr() for t in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in owned:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    b = 2
    x = torch.randn(b, 64, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, model.cos, model.sin, None)
    lay = Layout(micro_batch_size=b)
    predicted = layer_activation_bytes(spec_dims(cfg), lay, Precision.for_dtype("fp32"), linear=True)
    assert sum(st.nbytes() for st in saved.values()) == predicted


def _qwen35(seq: int, hybrid: bool = True) -> ModelDims:
    dims = ModelDims(**{k: v for k, v in presets()["qwen3.5"].items() if v is not None})
    dims = replace(dims, seq_len=seq)
    return dims if hybrid else replace(dims, linear_layers=(), linear=None)


def test_linear_layers_memory_and_cache_grow_linearly() -> None:
    """A linear layer's saved bytes double with the sequence (no s^2 term; its chunk states are per 64 tokens),
    its generation cache stays the same; a full layer's cache doubles."""
    lay, prec = Layout(tp=4, sp=True), Precision()
    short, long = _qwen35(32768), _qwen35(65536)
    ratio = layer_activation_bytes(long, lay, prec, linear=True) / layer_activation_bytes(short, lay, prec, linear=True)
    assert 1.99 < ratio <= 2.0  # linear, up to the per-micro-batch constant
    assert linear_cache_bytes(short, 1, 2) == linear_cache_bytes(long, 1, 2) > 0


def test_qwen35_is_cheaper_than_all_full_at_long_sequences() -> None:
    """The same layout at 128k tokens: the hybrid's FLOPs, activations, cp bytes and step time are below the all-full
    model's; the gap in FLOPs grows with the sequence (attention's s^2 against the recurrence's s)."""
    lay = Layout(tp=4, sp=True, pp=2, cp=2, global_batch_size=4)
    gaps = []
    for seq in (32768, 131072):
        hybrid, full = (estimate(_qwen35(seq, h), lay, hw=H100) for h in (True, False))
        for name in ("model_flops_per_step", "hardware_flops_per_step", "step_seconds"):
            assert _number(getattr(hybrid, name)) < _number(getattr(full, name)), name
        assert hybrid.memory.activations < full.memory.activations
        assert hybrid.comm_bytes["cp"] < full.comm_bytes["cp"]
        gaps.append(_number(full.model_flops_per_step) / _number(hybrid.model_flops_per_step))
    assert gaps[1] > gaps[0] > 1.0


def _number(x: float | None) -> float:
    assert x is not None  # a model shape and a peak were given: every figure is there
    return x


def test_planner_ranks_the_hybrid_faster_at_long_sequences() -> None:
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GB, intra_bytes_per_s=450 * GB,
                      inter_bytes_per_s=25 * GB, peak_flops=989e12)
    best = [make_plan(_qwen35(32768, h), cluster, global_batch_size=8).ranked[0] for h in (True, False)]
    assert best[0].step_seconds < best[1].step_seconds
    assert _number(best[0].est.model_flops_per_step) < _number(best[1].est.model_flops_per_step)
