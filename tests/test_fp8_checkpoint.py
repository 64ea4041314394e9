"""DeepSeek's block-scaled FP8 weights dequantised on load (megalite/fp8/checkpoint.py): against a block-by-block
hand computation (edge blocks partial), transformers' own dequantisers, and megalite's blockwise quantiser."""

from __future__ import annotations

import pytest
import torch

from megalite.errors import CheckpointError
from megalite.fp8.blocks import quantize_blocks
from megalite.fp8.checkpoint import dequantize_block_fp8, scale_inv_name

fp8_hf = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _checkpoint_weight(rows: int, cols: int, seed: int, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight and a scale grid as DeepSeek's checkpoints hold them (scales not powers of two)."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(*lead, rows, cols, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*lead, -(-rows // 128), -(-cols // 128), generator=gen) * 1e-3 + 1e-5
    return w, s


def test_dequantise_is_each_block_times_its_scale() -> None:
    w, s = _checkpoint_weight(200, 300, 1)  # 2 x 3 blocks; the last row and column of blocks are partial
    want = torch.empty(200, 300)
    for i in range(2):
        for j in range(3):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            want[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = block.float() * s[i, j].item()
    assert torch.equal(dequantize_block_fp8(w, s, dtype=torch.float32), want)
    assert torch.equal(dequantize_block_fp8(w, s), want.to(torch.bfloat16))  # fp32 product, rounded once


def test_matches_transformers_dequantisers() -> None:
    w, s = _checkpoint_weight(256, 384, 2)  # whole blocks: the load-time converter's case
    hf = fp8_hf.Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16)
    assert torch.equal(dequantize_block_fp8(w, s), hf)
    w, s = _checkpoint_weight(200, 300, 3, lead=(4,))  # partial edge blocks, stacked experts
    hf = fp8_hf._dequantize_fp8_weight(w, s, [128, 128], torch.float32)
    assert torch.equal(dequantize_block_fp8(w, s, dtype=torch.float32), hf)


def test_reads_back_megalites_blockwise_quantisation() -> None:
    """128 x 128 blocks quantised by the blockwise recipe, dequantised as a checkpoint would be: the same values."""
    t = torch.randn(260, 130)
    q = quantize_blocks(t, 128, 128, "blockwise")
    assert torch.equal(dequantize_block_fp8(q.data, q.scale, dtype=torch.float32), q.dequantize())


def test_a_wrong_scale_grid_is_one_line() -> None:
    w, s = _checkpoint_weight(200, 300, 4)
    assert scale_inv_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match=r"down.weight_scale_inv: shape \(2, 2\) is not the 128x128 block grid"):
        dequantize_block_fp8(w, s[:, :2], name="down.weight")
    with pytest.raises(CheckpointError, match="expected a float8 weight"):
        dequantize_block_fp8(w.float(), s)
