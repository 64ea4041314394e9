"""moe.shared_gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE): the shared experts' output scaled per token by
sigmoid(x . w), w [1, h] replicated like the router. Checked: the layer computes routed + sigmoid(x w) shared(x);
at ep2 (dp 2, each rank half the experts) and at tp2 + SP (each rank gates its own tokens, so w's gradient is a
partial sum over tp that must be all-reduced) the losses, gradient norms and every parameter after 3 AdamW steps
equal one process's (tests/test_moe_ep.py `_check`, its tolerances). Its equality to transformers' Qwen3-Next and
Qwen3.5-MoE blocks is in tests/test_hf_qwen3_5.py."""

from __future__ import annotations

from typing import Any

import torch

from tests.test_moe_ep import _check
from tests.test_moe_layer import _layer

GATE: dict[str, Any] = dict(moe_shared_experts=1, moe_shared_ffn_hidden_size=16, moe_shared_gate=True)


def test_the_gate_scales_the_shared_experts_output() -> None:
    layer = _layer(**GATE).eval()
    assert layer.shared is not None and layer.shared_gate is not None
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = layer(x)
        gate, shared = layer.shared_gate, layer.shared
        layer.shared_gate = None
        ungated = layer(x)
        want = ungated - shared(x) + torch.sigmoid(x @ gate.weight.t()) * shared(x)
        assert (got - ungated).abs().max() > 0.1 * shared(x).abs().max()  # the gate bites (sigmoid ~ 1/2 at init)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-5)  # outputs ~1e-4 (init std 0.02): fp32 round-off


def _world2(rank: int) -> None:
    _check(rank, 1, 1, 1, False, 0, 2, **GATE)  # ep2 over dp 2
    _check(rank, 2, 1, 1, True, 1, 1, **GATE)   # tp2 + SP, ZeRO-1


def test_ep2_and_tp2_sp_equal_one_process(dist_world) -> None:
    dist_world(2).run(_world2)
