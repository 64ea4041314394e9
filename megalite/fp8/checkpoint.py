"""DeepSeek's released FP8 checkpoints (DeepSeek-V3 / R1 on the hub), dequantised on load.

Those checkpoints store each quantised linear weight W [out, in] as float8_e4m3fn beside `<name>.weight_scale_inv`, a
float32 [ceil(out / 128), ceil(in / 128)] tensor holding one dequantiser per 128 x 128 block (the model's
`quantization_config.weight_block_size`; the scale is "inv" because W_true = W_fp8 x scale_inv, the inverse of the
multiplier the quantiser applied). Edge blocks are partial when a dim is not a multiple of 128; their scale covers
the elements present. Dequantising is

    w[i, j] = float(W_fp8[i, j]) * scale_inv[i // 128, j // 128]      in fp32, rounded once to the load dtype

which is DeepSeek's own `weight_dequant` (inference/kernel.py: fp32 product, stored in the default dtype) and
transformers' `Fp8Dequantize` (integrations/finegrained_fp8.py, whole blocks only): tests/test_fp8_checkpoint.py
checks both. An importer (the HF DeepseekV3 reader) calls `dequantize_block_fp8` for every weight that has a
`weight_scale_inv` sibling, `scale_inv_name` gives that sibling's name, and trains the bf16 / fp32 result.
"""

from __future__ import annotations

import torch

from megalite.errors import CheckpointError

Tensor = torch.Tensor
DEEPSEEK_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
SCALE_SUFFIX = "_scale_inv"


def scale_inv_name(weight_name: str) -> str:
    """The checkpoint name of a weight's block dequantisers: `...proj.weight` -> `...proj.weight_scale_inv`."""
    return weight_name + SCALE_SUFFIX


def dequantize_block_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = DEEPSEEK_BLOCK,
                         dtype: torch.dtype = torch.bfloat16, name: str = "weight") -> Tensor:
    """W_fp8 [..., out, in] (any float8 dtype) times its per-block `scale_inv` [..., cdiv(out, block[0]),
    cdiv(in, block[1])] broadcast over each block (edge blocks partial), in fp32, returned in `dtype`. Leading
    dims (stacked experts) are kept. A scale grid of the wrong shape is a CheckpointError naming `name`."""
    if weight.dim() < 2 or not weight.dtype.is_floating_point or weight.element_size() != 1:
        raise CheckpointError(f"{name}: expected a float8 weight of 2 or more dims, got {weight.dtype} "
                              f"{tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    grid = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise CheckpointError(f"{scale_inv_name(name)}: shape {tuple(scale_inv.shape)} is not the {block[0]}x{block[1]} "
                              f"block grid {grid} of {name} {tuple(weight.shape)}: check the checkpoint's "
                              "quantization_config.weight_block_size")
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * s).to(dtype)
