"""Kimi Delta Attention against transformers' KimiLinearDeltaAttention (its torch fallbacks, the real peer) with the
same weights: forward, input gradient and every weight gradient. Packing, generation and tp2 run in
tests/test_gdn_layer.py, parametrised over the layer kind.

Tolerance (fp32): as test_gdn_layer.py's, the same sums in another order (~1e-7 relative on O(1) values); 1e-5
absolute leaves two orders of margin, while a wrong gate, a wrong activation or a wrong shard moves values by O(0.1).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from megalite.kernels.testing import use_interpreter
from megalite.parallel.state import ParallelState
from megalite.recurrent.engine import Backend
from megalite.recurrent.kimi_delta import KimiDeltaAttention
from tests.test_gdn_layer import ATOL, KDA_CFG, match_peer


def hf_kda_layer(layer: KimiDeltaAttention) -> Any:
    """transformers' KimiLinearDeltaAttention with `layer`'s (tp1) weights."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    c = layer.cfg
    hf_cfg = KimiLinearConfig(hidden_size=c.hidden_size, linear_num_heads=c.num_value_heads,
                              linear_head_dim=c.key_head_dim, linear_conv_kernel_dim=c.conv_kernel,
                              rms_norm_eps=c.norm_eps, num_hidden_layers=1, layer_types=["linear_attention"])
    hf = KimiLinearDeltaAttention(hf_cfg, 0)
    q, k, v, b = layer.in_proj.weight.detach().split([c.key_dim, c.key_dim, c.value_dim, c.num_value_heads])
    fg = hf.forget_gate
    with torch.no_grad():
        for dst, src in ((hf.q_proj.weight, q), (hf.k_proj.weight, k), (hf.v_proj.weight, v), (hf.b_proj.weight, b),
                         (hf.conv1d.weight, layer.conv_weight[:, None]), (fg.f_a_proj.weight, layer.f_a.weight),
                         (fg.f_b_proj.weight, layer.f_b.weight), (fg.dt_bias, layer.dt_bias),
                         (fg.A_log, layer.A_log.view(1, 1, -1, 1)), (hf.g_a_proj.weight, layer.g_a.weight),
                         (hf.g_b_proj.weight, layer.g_b.weight), (hf.o_norm.weight, layer.norm_weight),
                         (hf.o_proj.weight, layer.out_proj.weight)):
            dst.copy_(src)
    return hf


def _hf_grads(hf: Any) -> dict[str, torch.Tensor]:
    """transformers' weight gradients under megalite's names."""
    fg = hf.forget_gate
    return {"in_proj.weight": torch.cat([hf.q_proj.weight.grad, hf.k_proj.weight.grad, hf.v_proj.weight.grad,
                                         hf.b_proj.weight.grad]),
            "conv_weight": hf.conv1d.weight.grad[:, 0], "f_a.weight": fg.f_a_proj.weight.grad,
            "f_b.weight": fg.f_b_proj.weight.grad, "dt_bias": fg.dt_bias.grad, "A_log": fg.A_log.grad.flatten(),
            "g_a.weight": hf.g_a_proj.weight.grad, "g_b.weight": hf.g_b_proj.weight.grad,
            "norm_weight": hf.o_norm.weight.grad, "out_proj.weight": hf.o_proj.weight.grad}


@pytest.mark.parametrize("backend,seq", [("chunked", 37), ("recurrent", 21), ("triton", 37)])
def test_layer_matches_transformers(backend: Backend, seq: int) -> None:
    """Forward, input gradient and every weight gradient equal transformers' Kimi Linear layer; the sequence is
    longer than a chunk (16 here) and not a multiple of it (transformers pads to its chunk of 64). The Triton
    kernels run in the interpreter."""
    if backend == "triton":
        use_interpreter()
    torch.manual_seed(0)
    layer = KimiDeltaAttention(replace(KDA_CFG, backend=backend), ParallelState(), name="layers.0.mixer", seed=3)
    hf = hf_kda_layer(layer)
    # weight gradients relative to their size: in_proj's and out_proj's sum 74 tokens' products, O(30) here
    match_peer(layer, hf, lambda: _hf_grads(hf), seq, grad_rtol=ATOL)
