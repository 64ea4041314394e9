"""FP8 in one process: the `_scaled_mm` wrapper, the FP8 linear against a plain-torch emulation (quantize,
dequantize, matmul in fp32) to the bit, the filter, the config errors, and the estimator's FP8 and MFU figures.

Why bitwise: torch 2.13's CPU `_scaled_mm` dequantizes and multiplies in fp32 (megalite/fp8/scaled_mm.py),
and the scales are powers of two, so `(q.float() * scale) @ (q.float() * scale)` is the same computation, done
by the same fp32 GEMM; the emulation below computes its scales independently (float64 log2, not frexp).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from megalite.config import Config, validate
from megalite.errors import ConfigError
from megalite.fp8 import scaled_mm as smm
from megalite.fp8.config import FP8Config
from megalite.fp8.costs import Splits, fp8_filter
from megalite.fp8.linear import Fp8Gemm
from megalite.fp8.scaled_mm import pow2_scale
from megalite.layers.linear_fn import part_blocks
from megalite.parallel.state import ParallelState
from megalite.perfmodel.estimate import Hardware, Layout, estimate
from megalite.perfmodel.flops import flops_per_token, hfu_ratio, peak_flops
from megalite.perfmodel.inputs import ModelDims

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_scaled_mm_is_available_with_every_mode_megalite_uses() -> None:
    smm.check_available()  # fails here, with one line, on a torch without _scaled_mm / float8
    a, b = torch.randn(16, 32).to(E4M3), torch.randn(32, 24).to(E4M3)
    g = torch.randn(16, 32).to(E5M2)
    ra, rb = torch.rand(16, 1) + 0.5, torch.rand(1, 24) + 0.5
    for x, sa, sb in ((a, torch.tensor(0.5), torch.tensor(2.0)), (a, ra, rb), (g, torch.tensor(0.25), torch.tensor(4.0)),
                      (g, ra, rb)):
        want = (x.float() * sa) @ (b.float() * sb)
        assert torch.equal(smm.scaled_mm(x, b, sa, sb, torch.float32), want)
        assert torch.equal(smm.scaled_mm(x, b.t().contiguous().t(), sa, sb, torch.bfloat16), want.bfloat16())


def test_check_available_fails_clearly_without_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(ConfigError, match="torch._scaled_mm"):
        smm.check_available()


def test_pow2_scales() -> None:
    amax = torch.tensor([448.0, 449.0, 1.0, 3e-30, 0.0, float("inf"), 57344.0])
    mult, dequant = pow2_scale(amax, E4M3)
    finite = amax[:4]
    assert torch.all(finite * mult[:4] <= 448.0) and torch.all(finite * mult[:4] * 2 > 448.0)
    assert torch.equal(mult * dequant, torch.ones(7)) and mult[5] == 1.0  # inf left for the step-skip logic
    assert pow2_scale(torch.tensor(57344.0), E5M2)[0] == 1.0


def _emulate_q(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    k = torch.floor(torch.log2(fmax / amax.double()))  # the largest k with amax * 2^k <= fmax
    return (t.double() * torch.exp2(k)).float().to(dtype).float(), torch.exp2(-k).float()


def _emulate(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    gd = E5M2 if recipe == "tensorwise" else E4M3
    rows = recipe == "rowwise"
    qx, sx = _emulate_q(x, E4M3, 1 if rows else None)
    qw, sw = _emulate_q(w, E4M3, 1 if rows else None)
    y = (qx * sx) @ (qw * sw).t()
    qg, sg = _emulate_q(g, gd, 1 if rows else None)
    qw2, sw2 = _emulate_q(w, E4M3, 0 if rows else None)
    dx = (qg * sg) @ (qw2 * sw2)
    qg3, sg3 = _emulate_q(g, gd, 0 if rows else None)
    qx3, sx3 = _emulate_q(x, E4M3, 0 if rows else None)
    dw = (qg3 * sg3).t() @ (qx3 * sx3)
    return y, dx, dw


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_the_emulation_to_the_bit(recipe: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen) * torch.exp2(torch.linspace(-4, 4, 24)).view(-1, 1)
    w = torch.randn(48, 32, generator=gen) * 0.1
    g = torch.randn(24, 48, generator=gen) * 1e-3
    gemm = Fp8Gemm(recipe, Splits((), (), ()), ParallelState())  # type: ignore[arg-type]
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ys = gemm.linear_parts(xr, wr, None, part_blocks([32, 8, 8]))  # fused parts: one quantization, three GEMMs
    torch.autograd.backward(ys, list(g.split([32, 8, 8], dim=1)))
    y, dx, dw = _emulate(x, w, g, recipe)
    assert torch.equal(torch.cat(ys, dim=1), y)
    assert torch.equal(xr.grad, dx) and torch.equal(wr.grad, dw)  # type: ignore[arg-type]
    # The fold path adds the same fp32 dW into the main grad.
    main = torch.zeros_like(w)
    w2 = w.clone().requires_grad_(True)
    gemm.linear(x, w2, fold=lambda add: add(main)).backward(g)
    assert torch.equal(main, dw) and w2.grad is None
    # bf16 activations: outputs rounded once from the same fp32 result (x is exactly representable).
    xb = x.bfloat16()
    assert torch.equal(gemm.linear(xb, w), _emulate(xb.float(), w, g, recipe)[0].bfloat16())


def test_filter_keeps_the_head_and_small_gemms_in_the_run_dtype() -> None:
    assert fp8_filter("layers.0.mlp.up", 128, [352, 352], 128)
    assert not fp8_filter("head", 4096, [32000], 16)
    assert not fp8_filter("layers.0.attn.qkv", 128, [128, 64, 64], 128)  # a 64-row part is below 128


def _cfg(dtype: str = "auto", **fp8: Any) -> Config:
    cfg = Config(fp8=FP8Config(**fp8))  # an unknown field is a TypeError, not an attribute nothing reads
    cfg.train.dtype = dtype
    return cfg


def test_fp8_config_errors_are_one_line() -> None:
    validate(_cfg(recipe="rowwise", dtype="bf16"), 1)
    for kw, text in ((dict(recipe="delayed"), "fp8.recipe: 'delayed' is not one of"),
                     (dict(recipe="tensorwise", dtype="fp16"), "fp16"),
                     (dict(recipe="rowwise", min_dim=0), "fp8.min_dim must be >= 1")):
        with pytest.raises(ConfigError, match=text):
            validate(_cfg(**kw), 1)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        validate(_cfg(recipe="rowwise"), 1, device_type="cuda")


DIMS = ModelDims(num_layers=16, hidden_size=2048, num_heads=32, vocab_size=128256, seq_len=2048, num_kv_heads=8,
                 ffn_hidden_size=8192)


def test_fp8_peaks_and_the_estimate() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 1979e12 and peak_flops("NVIDIA H200", "fp8") == 1979e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    lay = Layout(tp=2, sp=True, micro_batch_size=1, global_batch_size=4)
    base = estimate(DIMS, lay, hw=Hardware(peak_flops=989e12, intra_bytes_per_s=300e9))
    est = estimate(DIMS, lay, hw=Hardware(peak_flops=989e12, intra_bytes_per_s=300e9, fp8_peak_flops=1979e12),
                   fp8=("rowwise", 128))
    assert est.fp8 is not None and all(g["fp8"] for g in est.fp8["gemms"])
    layer_weights = sum(g["in_features"] * sum(g["out_parts"]) for g in est.fp8["gemms"]) * DIMS.num_layers
    assert est.fp8["fp8_flops_fraction"] == pytest.approx(6 * layer_weights / flops_per_token(DIMS, 0, "none")[1])
    assert est.comm_bytes["tp"] - base.comm_bytes["tp"] == pytest.approx(est.fp8["amax_bytes"]["tp"])
    assert est.compute_seconds < base.compute_seconds  # type: ignore[operator]
    # MFU stays over the bf16 peak: the same model FLOPs, less time; the FP8-peak figure is beside it.
    assert est.model_flops_per_step == base.model_flops_per_step
    assert est.predicted_mfu_fp8_peak == pytest.approx(est.predicted_mfu * 989 / 1979)  # type: ignore[operator]


def test_mfu_conventions_and_one_flop_count() -> None:
    for rc in ("none", "selective", "full"):
        est = estimate(DIMS, Layout(recompute=rc, micro_batch_size=1), hw=Hardware(peak_flops=989e12, intra_bytes_per_s=1e11))
        assert est.predicted_hfu >= est.predicted_mfu > est.predicted_mfu_causal  # type: ignore[operator]
        if rc == "none":
            assert est.predicted_hfu == est.predicted_mfu
        attn = 12.0 * DIMS.num_layers * DIMS.hidden_size * DIMS.seq_len * DIMS.seq_len  # per sequence
        assert est.model_flops_per_step - est.model_flops_causal_per_step == pytest.approx(attn / 2)  # type: ignore[operator]
    # Korthikanti et al. 2022 Table 5's selective-recompute convention, against its printed formula.
    s, h, v, layers = 2048.0, 12288.0, 51200.0, 96.0
    gpt3 = ModelDims(num_layers=96, hidden_size=12288, num_heads=96, vocab_size=51200, seq_len=2048, arch="gpt2")
    paper = (1 + s / (3 * h) + v / (12 * h * layers)) / (1 + s / (6 * h) + v / (12 * h * layers))
    assert hfu_ratio(gpt3, "selective", "korthikanti") == pytest.approx(paper, rel=1e-12)
    executed = (1 + 2 * s / (9 * h) + v / (12 * h * layers)) / (1 + s / (6 * h) + v / (12 * h * layers))
    assert hfu_ratio(gpt3, "selective") == pytest.approx(executed, rel=1e-12)
    assert hfu_ratio(gpt3, "full", "korthikanti") == hfu_ratio(gpt3, "full") == pytest.approx(
        96 * (1 + s / (6 * h) + v / (16 * h * layers)) / (72 * (1 + s / (6 * h) + v / (12 * h * layers))), rel=1e-12)
    assert math.isclose(hfu_ratio(gpt3, "none", "korthikanti"), 1.0)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198),
# Table 5 (selective recompute + sequence parallelism; the same cells in Megatron-LM's README table):
# (heads, hidden, layers) of its Table 3's GPT-3-style models (s = 2048, V = 51200), MFU and HFU in percent.
TABLE5 = {"22B": (64, 6144, 48, 41.5, 43.7), "175B": (96, 12288, 96, 51.4, 52.8),
          "530B": (128, 20480, 105, 56.0, 57.0), "1T": (160, 25600, 128, 56.3, 57.0)}


@pytest.mark.parametrize("row", list(TABLE5))
def test_korthikanti_convention_reproduces_table5_hfu(row: str) -> None:
    heads, h, layers, mfu, hfu = TABLE5[row]
    dims = ModelDims(num_layers=layers, hidden_size=h, num_heads=heads, vocab_size=51200, seq_len=2048, arch="gpt2")
    ratio = hfu_ratio(dims, "selective", "korthikanti")
    # The cells are rounded to 0.1: some MFU in [mfu - 0.05, mfu + 0.05) must give an HFU in [hfu - 0.05, hfu + 0.05).
    lo, hi = (mfu - 0.05) * ratio, (mfu + 0.05) * ratio
    assert lo < hfu + 0.05 and hi >= hfu - 0.05, f"{row}: MFU {mfu}% gives HFU {lo:.2f}-{hi:.2f}%, Table 5 {hfu}%"
    if row == "22B":  # the executed count (the default) does not: it is what the devices ran, 3.5% fewer FLOPs
        assert (mfu + 0.05) * hfu_ratio(dims, "selective") < hfu - 0.05
    # One FLOP count in the estimator: HFU = MFU x the ratio, so HFU >= MFU in every mode and convention.
    for rc in ("none", "selective", "full"):
        for conv in ("executed", "korthikanti"):
            est = estimate(dims, Layout(recompute=rc, micro_batch_size=1),
                           hw=Hardware(peak_flops=312e12, intra_bytes_per_s=1e11), hfu_convention=conv)
            assert est.predicted_hfu >= est.predicted_mfu, (rc, conv)  # type: ignore[operator]
            assert est.predicted_hfu == pytest.approx(est.predicted_mfu * hfu_ratio(dims, rc, conv), rel=1e-12)  # type: ignore[operator]
