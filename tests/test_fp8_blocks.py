"""The block recipes' quantisers (megalite/fp8/blocks.py) against torchao's pure-torch references, bit for bit:
the e4m3 payload bytes and the scales of DeepSeek-V3's blockwise recipe (1 x 128 activation tiles, 128 x 128
weight blocks, 128 x 1 for the weight gradient's activations) and of MX (1 x 32 blocks, e8m0 exponents, RCEIL);
partial edge blocks against a hand count; and the FP8 linear's three GEMMs against an emulation built from
torchao's quantisers (equal to the bit: the same fp8 values and scales, then the same fp32 matmul)."""

from __future__ import annotations

import pytest
import torch

from megalite.config import Config, validate
from megalite.errors import ConfigError
from megalite.fp8.blocks import Blocked, block_amax, e8m0, quantize_blocks
from megalite.fp8.costs import BLOCK, WEIGHT_BLOCK, Splits, local_sizes, scale_bytes, scale_elements
from megalite.fp8.experts import Fp8ExpertGemm
from megalite.fp8.linear import Fp8Gemm
from megalite.parallel.state import ParallelState
from megalite.perfmodel.estimate import Layout, estimate
from megalite.perfmodel.fp8 import layer_gemms
from megalite.perfmodel.inputs import Hardware, ModelDims

torchao_blockwise = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")


def wide(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values spanning 2^-20..2^8 over rows and columns, a zero block's worth of zeros, a lone outlier."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.linspace(-20, 8, rows)).view(-1, 1)
    t = t * torch.exp2(torch.linspace(4, -4, cols))
    t[0, :128] = 0.0
    t[-1, 3] = 3e4
    return t.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_activation_tiles_match_torchao(dtype: torch.dtype) -> None:
    x = wide(6, 384, 1, dtype)
    want_q, want_s = torchao_blockwise.torch_blockwise_scale_act_quant_lhs(x, 128)
    got = quantize_blocks(x, 1, 128, "blockwise")
    assert torch.equal(_bytes(got.data), _bytes(want_q))
    assert torch.equal(got.scale.view(torch.int32), want_s.contiguous().view(torch.int32))


def test_blockwise_weight_blocks_match_torchao() -> None:
    w = wide(256, 384, 2)
    want_q, want_s = torchao_blockwise.torch_blockwise_scale_weight_quant(w, 128)
    got = quantize_blocks(w, 128, 128, "blockwise")
    assert got.scale.shape == (2, 3)
    assert torch.equal(_bytes(got.data), _bytes(want_q)) and torch.equal(got.scale, want_s)


def test_blockwise_token_blocks_match_torchao() -> None:
    """The weight gradient's x: 128 x 1 blocks of x [T, in] (torchao's `act_quant_rhs`) = 1 x 128 of x^T."""
    x = wide(256, 128, 3)
    x[0, :] = x[1, :]  # wide() zeroed a row: no all-zero block here (torchao clamps its amax in fp32 there)
    want_q, want_s = torchao_blockwise.torch_blockwise_scale_act_quant_rhs(x, 128)
    got = quantize_blocks(x.t(), 1, 128, "blockwise")
    assert torch.equal(_bytes(got.data.t()), _bytes(want_q)) and torch.equal(got.scale.t(), want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_blocks_match_torchao(dtype: torch.dtype) -> None:
    x = wide(8, 256, 4, dtype)
    x[2, 40] = float("nan")  # a NaN block: exponent 255, and the NaN stays for the step-skip
    want_e, want_q = mx.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=mx_config.ScaleCalculationMode.RCEIL)
    got = quantize_blocks(x, 1, 32, "mxfp8")
    assert torch.equal(_bytes(got.data), _bytes(want_q))
    assert torch.equal(_bytes(e8m0(got.scale)), _bytes(want_e))
    assert e8m0(got.scale)[2, 1].view(torch.uint8) == 255
    fp = mx.get_fp_scale(want_e)
    assert torch.equal(got.scale.isnan(), fp.isnan())
    assert torch.equal(got.scale.nan_to_num(), fp.nan_to_num())


def test_partial_edge_blocks_are_quantised_alone() -> None:
    """A dim not a multiple of the block: the edge block's amax is over the elements present, so its payload
    and scale are those of quantising that block by itself."""
    t = wide(130, 200, 5)
    for recipe, rows, cols in [("blockwise", 128, 128), ("blockwise", 1, 128), ("mxfp8", 1, 32)]:
        whole = quantize_blocks(t, rows, cols, recipe)
        r0, c0 = (t.shape[0] - 1) // rows * rows, (t.shape[1] - 1) // cols * cols
        edge = quantize_blocks(t[r0:, c0:].contiguous(), rows, cols, recipe)
        assert torch.equal(_bytes(whole.data[r0:, c0:]), _bytes(edge.data)), recipe
        assert torch.equal(whole.scale[-1:, -1:], edge.scale[-1:, -1:]), recipe
        assert torch.equal(block_amax(t, rows, cols)[-1, -1], t[r0:, c0:].abs().max())


def _torchao_blocked(t: torch.Tensor, rows: int, recipe: str) -> Blocked:
    """t [M, K] quantised by torchao along K (blockwise: 1 x 128 or 128 x 128; mxfp8: 1 x 32), as a `Blocked`."""
    t = t.contiguous()
    if recipe == "mxfp8":
        e, q = mx.to_mx(t, torch.float8_e4m3fn, 32, scaling_mode=mx_config.ScaleCalculationMode.RCEIL)
        return Blocked(q, mx.get_fp_scale(e), 1, 32)
    quant = torchao_blockwise.torch_blockwise_scale_act_quant_lhs if rows == 1 else \
        torchao_blockwise.torch_blockwise_scale_weight_quant
    q, s = quant(t, 128)
    return Blocked(q, s.contiguous(), rows, 128)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_the_linear_is_torchaos_quantisers_then_an_fp32_matmul(recipe: str) -> None:
    """fprop, dgrad and wgrad of one FP8 linear, bit for bit against torchao's quantised operands dequantised and
    multiplied in fp32 (blocks along each GEMM's contraction dim: megalite/fp8/blocks.py's table)."""
    t, n_in, n_out = 256, 256, 384
    rows = 128 if recipe == "blockwise" else 1  # the weight's blocks along its other dim
    x = wide(t, n_in, 6).requires_grad_(True)
    w = (wide(n_out, n_in, 7) * 1e-3).requires_grad_(True)
    g = wide(t, n_out, 8)
    gemm = Fp8Gemm(recipe, Splits((), (), ()), ParallelState())  # type: ignore[arg-type]
    y = gemm.linear(x, w)
    y.backward(g)

    def mm(a: Blocked, b: Blocked) -> torch.Tensor:
        return torch.mm(a.dequantize(), b.dequantize().t())

    wd = w.detach()
    assert torch.equal(y, mm(_torchao_blocked(x.detach(), 1, recipe), _torchao_blocked(wd, rows, recipe)))
    assert torch.equal(x.grad, mm(_torchao_blocked(g, 1, recipe), _torchao_blocked(wd.t(), rows, recipe)))
    assert torch.equal(w.grad, mm(_torchao_blocked(g.t(), 1, recipe), _torchao_blocked(x.detach().t(), 1, recipe)))


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_the_expert_gemms_are_torchaos_quantisers_per_expert(recipe: str) -> None:
    """The expert GEMMs under a block recipe: tokens in 1 x B blocks, each expert's weight in its own blocks, bit for
    bit against torchao's quantisers; an expert's output rows do not depend on its other rows (layout-free)."""
    counts, n_in, n_out = [130, 0, 3], 256, 128
    rows = 128 if recipe == "blockwise" else 1
    x = wide(sum(counts), n_in, 9).requires_grad_(True)
    w = (torch.randn(len(counts), n_out, n_in, generator=torch.Generator().manual_seed(10)) * 0.02).requires_grad_(True)
    g = wide(sum(counts), n_out, 11)
    gemm = Fp8ExpertGemm(recipe)  # type: ignore[arg-type]
    y = gemm.expert_mm(x, w, counts)
    y.backward(g)
    qx, qg = _torchao_blocked(x.detach(), 1, recipe), _torchao_blocked(g, 1, recipe)
    lo = 0
    for e, n in enumerate(counts):
        if n:
            a, b = qx.dequantize()[lo:lo + n], _torchao_blocked(w[e].detach(), rows, recipe).dequantize()
            assert torch.equal(y[lo:lo + n], torch.mm(a, b.t())), f"{recipe}: expert {e} forward"
            a, b = qg.dequantize()[lo:lo + n], _torchao_blocked(w[e].detach().t(), rows, recipe).dequantize()
            assert torch.equal(x.grad[lo:lo + n], torch.mm(a, b.t())), f"{recipe}: expert {e} dgrad"  # type: ignore[index]
        lo += n
    alone = gemm.expert_mm(x.detach()[130:], w, [0, 0, 3])
    assert torch.equal(alone, y[130:])


def test_scale_elements_count_the_blocks() -> None:
    """costs.scale_elements (the estimator's) against the scales the quantisers make for the three GEMMs."""
    t, n_in, n_out = 300, 256, 160
    x, w, g = torch.ones(t, n_in), torch.ones(n_out, n_in), torch.ones(t, n_out)
    for recipe in BLOCK:
        b, rows = BLOCK[recipe], WEIGHT_BLOCK[recipe]
        made = [quantize_blocks(x, 1, b, recipe), quantize_blocks(w, rows, b, recipe),        # fprop
                quantize_blocks(g, 1, b, recipe), quantize_blocks(w.t(), rows, b, recipe),    # dgrad
                quantize_blocks(g.t(), 1, b, recipe), quantize_blocks(x.t(), 1, b, recipe)]   # wgrad
        assert sum(q.scale.numel() for q in made) == scale_elements(recipe, t, n_in, n_out), recipe


def _block_cfg(recipe: str, tp: int, cp: int, seq_len: int, hidden: int, heads: int = 0) -> Config:
    cfg = Config()
    cfg.fp8.recipe, cfg.fp8.min_dim = recipe, 16
    cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads = hidden, heads or hidden // 32, heads or hidden // 32
    cfg.model.ffn_hidden_size, cfg.model.seq_len = 2 * hidden, seq_len
    cfg.parallel.tp, cfg.parallel.cp = tp, cp
    return cfg


def test_layouts_where_a_block_would_span_ranks_are_refused_in_one_line() -> None:
    validate(_block_cfg("blockwise", 2, 2, 512, 256), 4)  # every tp shard whole 128-blocks; cp chunks of 128
    validate(_block_cfg("mxfp8", 2, 2, 128, 128), 4)     # 64-wide shards, 32-token chunks: whole MX blocks
    for cfg, text in ((_block_cfg("blockwise", 2, 1, 128, 128), "attn.qkv splits a dimension of 128 into 64-wide"),
                      (_block_cfg("blockwise", 1, 2, 256, 256), "seq_len/\\(2 cp\\) = 64 tokens"),
                      (_block_cfg("mxfp8", 2, 1, 128, 96, heads=2), "48-wide shards, not whole 32-blocks")):
        with pytest.raises(ConfigError, match=text):
            validate(cfg, cfg.parallel.tp * cfg.parallel.cp)


def test_the_estimate_counts_block_scales_and_no_amax_traffic() -> None:
    dims = ModelDims(num_layers=4, hidden_size=1024, num_heads=8, vocab_size=32000, seq_len=1024, ffn_hidden_size=4096)
    lay = Layout(tp=2, cp=2, sp=True, micro_batch_size=1, global_batch_size=4)
    for recipe in BLOCK:
        est = estimate(dims, lay, hw=Hardware(peak_flops=989e12, intra_bytes_per_s=300e9, fp8_peak_flops=1979e12),
                       fp8=(recipe, 128))
        assert est.fp8 is not None and est.fp8["amax_bytes"] == {}
        tokens = 1024 // 2  # one micro-batch's tokens on a cp rank
        want = sum(scale_bytes(recipe, tokens, *local_sizes(g, 2)) for g in layer_gemms(dims, 128))
        assert est.fp8["scale_bytes"] == want > 0
