"""The Mamba2 layer against transformers' NemotronHMamba2Mixer (its torch fallback, the real peer) with the same
weights, packed documents against each document alone, generation against the full forward, and tp2 (with and
without SP) against one process on gloo ranks.

Tolerances (fp32): the same sums in another order (the engine's chunks of 16 against transformers' chunks of its own
size, TP's per-shard partial sums then an all-reduce), ~1e-7 relative on O(1) values; 1e-5 absolute leaves two
orders of margin, while a wrong shard, a missed reset or a wrong gate moves values by O(0.1). Against transformers
the gradients reach O(30) (the group norm rescales outputs that a clamped dt keeps small), so there the bound is
1e-5 relative to the largest entry.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.recurrent.engine import Backend
from megalite.recurrent.mamba2 import Mamba2, Mamba2Config
from tests.test_gdn_layer import _close, _packed, _run, check_packed, check_tp

# 4 heads of width 6 in 2 groups (two heads read each group's B and C), state 8 != head width.
CFG = Mamba2Config(hidden_size=24, num_heads=4, head_dim=6, num_groups=2, state_size=8, chunk_size=16)


def _hf_layer(layer: Mamba2, hf_chunk: int) -> Any:
    """transformers' NemotronHMamba2Mixer with `layer`'s (tp1) weights."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    c = layer.cfg
    hf_cfg = NemotronHConfig(hidden_size=c.hidden_size, mamba_num_heads=c.num_heads, mamba_head_dim=c.head_dim,
                             n_groups=c.num_groups, ssm_state_size=c.state_size, conv_kernel=c.conv_kernel,
                             use_conv_bias=c.conv_bias, time_step_limit=c.dt_limit, layer_norm_epsilon=c.norm_eps,
                             chunk_size=hf_chunk, layers_block_type=["linear_attention"])
    hf = NemotronHMamba2Mixer(hf_cfg, 0)
    bias = hf.conv1d.bias
    assert bias is not None and layer.conv_bias is not None
    with torch.no_grad():
        for dst, src in ((hf.in_proj.weight, layer.in_proj.weight), (hf.conv1d.weight, layer.conv_weight[:, None]),
                         (bias, layer.conv_bias), (hf.A_log, layer.A_log), (hf.dt_bias, layer.dt_bias),
                         (hf.D, layer.D), (hf.norm.weight, layer.norm_weight), (hf.out_proj.weight, layer.out_proj.weight)):
            dst.copy_(src)
    return hf


def _perturbed(layer: Mamba2) -> Mamba2:
    """D and the norm weight moved off their init of ones (the same numbers at every layout: drawn whole, sliced)."""
    gen = torch.Generator().manual_seed(9)
    d, w = 1 + 0.5 * torch.randn(CFG.num_heads, generator=gen), 1 + 0.5 * torch.randn(CFG.inner, generator=gen)
    tp, r = layer.state.tp, layer.state.tp_rank
    with torch.no_grad():
        layer.D.copy_(d.chunk(tp)[r])
        layer.norm_weight.copy_(w.chunk(tp)[r])
    return layer


@pytest.mark.parametrize("backend,seq,limit", [("chunked", 37, (0.0, float("inf"))), ("chunked", 37, (0.0, 0.02)),
                                               ("recurrent", 21, (0.0, float("inf")))])
def test_layer_matches_transformers(backend: Backend, seq: int, limit: tuple[float, float]) -> None:
    """Forward, input gradient and every weight gradient equal transformers' NemotronH Mamba2 mixer; the sequence is
    longer than a chunk and not a multiple of it (transformers runs chunks of 8, megalite of 16); one case clamps
    dt to a limit the init reaches (dt is drawn in [1e-3, 1e-1])."""
    torch.manual_seed(0)
    layer = _perturbed(Mamba2(replace(CFG, backend=backend, dt_limit=limit), ParallelState(), name="layers.0.mixer",
                              seed=3))
    hf = _hf_layer(layer, hf_chunk=8)
    x, gy = torch.randn(2, seq, CFG.hidden_size), torch.randn(2, seq, CFG.hidden_size)
    y, gx = _run(layer, x, gy)
    y_hf, gx_hf = _run(hf, x, gy)
    _close(y, y_hf, "forward")
    _close(gx, gx_hf, "input gradient")
    hf_grads = {"in_proj.weight": hf.in_proj.weight.grad, "conv_weight": hf.conv1d.weight.grad[:, 0],
                "conv_bias": hf.conv1d.bias.grad, "A_log": hf.A_log.grad, "dt_bias": hf.dt_bias.grad, "D": hf.D.grad,
                "norm_weight": hf.norm.weight.grad, "out_proj.weight": hf.out_proj.weight.grad}
    assert set(hf_grads) == {n for n, _ in layer.named_parameters()}
    for name, g in hf_grads.items():
        mine = dict(layer.named_parameters())[name].grad
        assert mine is not None, name
        _close(mine, g, f"{name} gradient", atol=1e-5 * max(1.0, g.abs().max().item()))


def test_packed_documents_equal_each_document_alone() -> None:
    """A packed row with document ids: output, input gradient and every weight gradient equal each document run
    alone (the conv window and the state restart at every EOD); documents shorter than the conv window, ending
    inside a chunk and spanning a chunk boundary."""
    check_packed(lambda: Mamba2(CFG, ParallelState(), name="m", seed=3), CFG.hidden_size)


def test_generation_steps_equal_the_full_forward() -> None:
    """Prefill a prompt, then one token at a time from the cache (constant size): the outputs of the full forward."""
    torch.manual_seed(2)
    layer = Mamba2(CFG, ParallelState(), name="m", seed=3)
    x = torch.randn(2, 23, CFG.hidden_size)
    with torch.no_grad():
        full = layer(x)
        y, cache = layer.prefill(x[:, :17])
        outs = [y]
        for t in range(17, 23):
            y, cache = layer.step(x[:, t:t + 1], cache)
            assert cache.conv.shape == (2, CFG.conv_kernel - 1, CFG.inner + 2 * CFG.group_dim)
            assert cache.state.shape == (2, CFG.num_heads, CFG.state_size, CFG.head_dim)
            outs.append(y)
    _close(torch.cat(outs, dim=1), full, "prefill + steps vs the full forward")


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of n_groups=2"):
        Mamba2(replace(CFG, num_heads=3), ParallelState(), name="m", seed=0)
    with pytest.raises(ValueError, match="n_groups=2 must be divisible by tp=4"):
        CFG.check(4)
    with pytest.raises(ValueError, match="backend='chunked'"):
        replace(CFG, backend="triton").check(1)


def _build(st: ParallelState, name: str, seed: int) -> Mamba2:
    return _perturbed(Mamba2(CFG, st, name=name, seed=seed))


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_matches_one_process(dist_world, sp: bool) -> None:
    """Groups split with their heads (one group per rank): forward, input gradient and every weight gradient."""
    dist_world(2).run(check_tp, sp, _build, CFG.hidden_size)


def test_relu2_is_transformers_relu2() -> None:
    """Nemotron-H's MLP activation (model.mlp=relu2): relu(x)^2 on one up projection, as transformers' "relu2"."""
    from transformers.activations import ACT2FN

    from megalite.layers.activation import MLPActivation
    from megalite.model.ops import TORCH_OPS

    act = MLPActivation("relu2")
    x = torch.randn(3, 7)
    assert not act.gated
    torch.testing.assert_close(act(TORCH_OPS, [x]), ACT2FN["relu2"](x), rtol=0, atol=0)


def _config(**model: object) -> Any:
    from megalite.config.schema import Config

    cfg = Config()
    cfg.model.num_layers, cfg.model.layer_types = 5, ["mamba", "mlp", "mamba", "attention", "mlp"]
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


@pytest.mark.parametrize("model,parallel,says", [
    (dict(mamba_num_heads=6, mamba_n_groups=4), {}, "mamba_num_heads=6 must be a multiple of mamba_n_groups=4"),
    (dict(mamba_n_groups=1), dict(tp=2), "mamba_n_groups=1 divisible by parallel.tp=2"),
    ({}, dict(cp=2), "parallel.cp=2 with mamba layers is not supported yet"),
    (dict(mamba_state_size=0), {}, "model.mamba_state_size=0 must be >= 1"),
])
def test_bad_mamba_configs_say_what_is_wrong(model: dict, parallel: dict, says: str) -> None:
    from megalite.config.layers import layer_problems

    cfg = _config(**model)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    assert any(says in line for line in layer_problems(cfg)), layer_problems(cfg)
    assert not layer_problems(_config())


def test_one_part_layers_cost_their_part() -> None:
    """layer_costs prices Nemotron-H's one-part layers by the part they have: an mlp layer 2 x its MLP's weights, an
    attention layer no MLP (cheaper than the same layer as full_attention with its MLP), the mamba layers alike."""
    from megalite.model.pattern import layer_costs, layer_specs
    from tests.layer_pattern_utils import nemotron_cfg

    cfg = nemotron_cfg()
    costs = layer_costs(cfg)
    assert [(s.has_mixer, s.has_mlp) for s in layer_specs(cfg)] == [(True, False), (False, True), (True, False),
                                                                     (True, False), (False, True)]
    assert costs[1] == costs[4] == 2.0 * 2 * cfg.hidden_size * cfg.ffn_hidden_size  # relu2: up and down
    assert costs[0] == costs[2]
    with_mlp = layer_costs(nemotron_cfg(layer_types=["full_attention"] * 5))[3]
    assert with_mlp - costs[3] == costs[1]
