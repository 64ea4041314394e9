"""The recurrence's closed-form costs held to counts: the chunked form's matrix-product FLOPs to torch's FLOP
counter, the generation cache's bytes to the cache's tensors."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import chunked_gated_delta
from megalite.recurrent.costs import (RecurrentDims, chunked_flops, chunked_matmul_flops, cp_exchange_bytes,
                                      recurrent_flops, state_bytes, triangular_solve_flops)
from megalite.recurrent.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from megalite.recurrent.recurrence import RuleInputs


def test_matmul_flops_equal_torch_count() -> None:
    """Every matrix product of the chunked form, counted by torch (which does not count the triangular solve),
    for a length that pads its last chunk."""
    b, t, h, k, v, chunk = 2, 40, 3, 8, 6, 16
    q, kk = torch.randn(b, t, h, k), torch.randn(b, t, h, k)
    x = RuleInputs(q, kk, torch.randn(b, t, h, v), -torch.rand(b, t, h), torch.rand(b, t, h))
    with FlopCounterMode(display=False) as counter:
        chunked_gated_delta(x, doc_ids=None, scale=1.0, chunk_size=chunk)
    dims = RecurrentDims(heads=h, key_dim=k, value_dim=v, conv_channels=0)
    assert counter.get_total_flops() == chunked_matmul_flops(dims, b, t, chunk)


def test_flop_formula_shape() -> None:
    dims = RecurrentDims(heads=32, key_dim=128, value_dim=128, conv_channels=8192)
    # Qwen3.5-like at 4k tokens: the solve is a fraction of the matmuls; chunking trades C^2 work for parallelism.
    total = chunked_flops(dims, 1, 4096, 64)
    assert total == chunked_matmul_flops(dims, 1, 4096, 64) + triangular_solve_flops(dims, 1, 4096, 64)
    assert triangular_solve_flops(dims, 1, 4096, 64) < chunked_matmul_flops(dims, 1, 4096, 64) / 3
    assert recurrent_flops(dims, 1, 4096) < total  # fewer FLOPs, but 4096 sequential steps
    assert cp_exchange_bytes(dims, 1, 1) == 0
    assert cp_exchange_bytes(dims, 2, 4) == 3 * 2 * 32 * 128 * 256 * 4  # independent of the sequence length


def test_state_bytes_equal_the_cache() -> None:
    cfg = GatedDeltaNetConfig(hidden_size=16, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=4)
    layer = GatedDeltaNet(cfg, ParallelState(), name="m", seed=0)
    with torch.no_grad():
        _, cache = layer.prefill(torch.randn(3, 5, 16))
    dims = RecurrentDims(heads=4, key_dim=8, value_dim=4, conv_channels=2 * cfg.key_dim + cfg.value_dim)
    measured = sum(t.numel() * t.element_size() for t in (cache.conv, cache.state))
    assert measured == state_bytes(dims, 3, act_bytes=4)
