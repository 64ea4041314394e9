"""FP8 expert GEMMs (megalite/fp8/experts.py): against a plain-torch emulation to the bit, the filter
on the experts, a whole ep2 run against the single-process run for both recipes, and the estimator's count of the
FP8 modules (megalite/perfmodel/fp8_moe.py).

Bitwise: as in tests/test_fp8.py's module doc (CPU `_scaled_mm` dequantizes and multiplies in fp32, the
scales are powers of two, and the emulation computes its scales independently with a float64 log2).

The ep2 run is compared to the bit, over STEPS AdamW steps, for both recipes. Expert parallelism sends the rows of
two ranks' micro-batches to one expert, which the single-process run meets one micro-batch at a time; the expert
scales are per token and per weight only (an expert's output rows do not depend on its other rows: checked bitwise
below), so both quantize the same values. What remains is the order of the sums: with one micro-batch per rank, a
dense weight's gradient is (rank 0's) + (rank 1's), the single process's micro-batch 0 + micro-batch 1, and the
FP8 experts sum their weight gradient source rank by source rank (`sources`) for the same association; the
reference runs the same AdamW arithmetic (the ZeRO optimizer at stage 0 on one process); clipping is off (the
global norm is summed in another order: round-off, which clipping would spread to every gradient).

Why not round-off tolerances, as before: FP8 makes a run's outcome discontinuous in round-off. Traced with two
micro-batches per rank (tensorwise, seed 5): step 0 was bitwise everywhere but the gradients' summation order; one
element of layers.0.mlp.experts.down (expert 0, [10, 30]) had a gradient of -1.028e-10 in one process and
-1.164e-10 at ep2 (a near-total cancellation of terms ~1e-4: its value is round-off), which AdamW's first step
(lr g / (|g| + eps), eps 1e-8) turned into weights -2.9523e-4 and -2.8189e-4. Expert 0's scale (amax 4.148e-2,
2^13 in both runs) puts them at -2.419 and -2.309, either side of the e4m3 midpoint -2.375 between -2.5 and -2.25:
one fp8 weight differed, layer 0's MoE output moved by ~1e-4 of its largest value, and FP8 roundings downstream
amplified it (loss 1.3e-5 apart at step 1; parameters 1.8e-4 apart on average, 1.4e-2 at most, after 3 steps).
Setting that one weight to the single process's value after step 0 kept the runs at round-off for 3 steps.
Rowwise had the same Adam-amplified differences (up to 7.6e-7) with no element across a boundary, by luck. No scale
differed. With two micro-batches per rank no association can match (one process sums ((m0 + m1) + m2) + m3, ep2
(m0 + m1) + (m2 + m3)), hence one micro-batch per rank here.
"""

from __future__ import annotations

import pytest
import torch

from megalite.errors import ConfigError
from megalite.fp8.enable import Fp8Settings, enable_fp8
from megalite.fp8.experts import Fp8ExpertGemm
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import ADAMW, micro_batches, random_steps, tiny_train_cfg
from tests.test_fp8 import E4M3, _emulate_q
from tests.test_fp8_training import MIN_DIM
from tests.test_moe_ep import MICRO, SEQ, STEPS, _local_batches

COUNTS = [5, 0, 1, 10]  # an expert without rows and one with a single row


def _emulate(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    """y, dx, dw of the expert GEMMs: per-token activation and gradient scales, the weight's per expert
    (tensorwise) or per row / column (rowwise), the weight gradient in x's dtype."""
    rows = recipe == "rowwise"
    qx, sx = _emulate_q(x.float(), E4M3, 1)
    qg, sg = _emulate_q(g.float(), E4M3, 1)
    ys, dxs, dws, lo = [], [], [], 0
    for e, n in enumerate(COUNTS):
        sl = slice(lo, lo + n)
        qw, sw = _emulate_q(w[e], E4M3, 1 if rows else None)
        ys.append(((qx[sl] * sx[sl]) @ (qw * sw).t()).to(x.dtype))
        qw2, sw2 = _emulate_q(w[e], E4M3, 0 if rows else None)
        dxs.append(((qg[sl] * sg[sl]) @ (qw2 * sw2)).to(x.dtype))
        dws.append(torch.mm(g[sl].t(), x[sl]).float())
        lo += n
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_expert_gemms_match_the_emulation_to_the_bit(recipe: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n = sum(COUNTS)
    x = torch.randn(n, 32, generator=gen) * torch.exp2(torch.linspace(-4, 4, n)).view(-1, 1)
    w = torch.randn(len(COUNTS), 48, 32, generator=gen) * torch.tensor([0.1, 1.0, 0.01, 3.0]).view(-1, 1, 1)
    g = torch.randn(n, 48, generator=gen) * 1e-3
    gemm = Fp8ExpertGemm(recipe)  # type: ignore[arg-type]
    for dtype in (torch.float32, torch.bfloat16):  # bf16 runs: x and g exactly representable, outputs rounded once
        xd, gd = x.to(dtype), g.to(dtype)
        xr, wr = xd.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = gemm.expert_mm(xr, wr, COUNTS)
        y.backward(gd)
        want_y, want_dx, want_dw = _emulate(xd, w, gd, recipe)
        assert y.dtype == dtype and torch.equal(y, want_y), f"{recipe} {dtype}: forward"
        assert torch.equal(xr.grad, want_dx), f"{recipe} {dtype}: input gradient"  # type: ignore[arg-type]
        dw = wr.grad
        assert dw is not None and dw.dtype == torch.float32 and torch.equal(dw, want_dw), f"{recipe} {dtype}: dW"
        assert not dw[1].any()  # the expert without rows
    # Layout-free: expert 3's first rows give the same output when its other rows are 256x larger (a scale over
    # an expert's rows, which ep changes by gathering several ranks' rows, would change them).
    part = gemm.expert_mm(x[6:10], w, [0, 0, 0, 4])
    other = torch.cat([x[:6], x[6:10], x[10:] * 256])
    assert torch.equal(gemm.expert_mm(other, w, COUNTS)[6:10], part)
    # With `sources` (an expert's rows from each ep rank) the weight gradient is source 0's plus source 1's, each
    # from its own rows alone: what a single process accumulating those two micro-batches computes, to the bit.
    sources = [[2, 3], [0, 0], [1, 0], [4, 6]]  # of COUNTS' rows 0-4, none, 5, 6-15
    first, rest = torch.tensor([0, 1, 5, 6, 7, 8, 9]), torch.tensor([2, 3, 4, 10, 11, 12, 13, 14, 15])
    dws = []
    for rows, counts in ((first, [a for a, _ in sources]), (rest, [b for _, b in sources]),
                         (torch.arange(n), None)):
        wr = w.clone().requires_grad_(True)
        y = gemm.expert_mm(x[rows], wr, counts) if counts is not None else gemm.expert_mm(x, wr, COUNTS, sources)
        y.backward(g[rows])
        dws.append(wr.grad)
    assert torch.equal(dws[0] + dws[1], dws[2])


def test_the_filter_on_the_experts() -> None:
    cfg = tiny_moe_cfg(seq_len=SEQ)  # hidden 32, expert ffn 32
    chosen = enable_fp8([GPT(cfg, ParallelState(), seed=5)], Fp8Settings("rowwise", 32), ParallelState())
    assert {n for n in chosen if n.endswith("experts")} == {"layers.0.mlp.experts", "layers.1.mlp.experts"}, chosen
    model = GPT(cfg, ParallelState(), seed=5)
    assert not [n for n in enable_fp8([model], Fp8Settings("rowwise", 33), ParallelState()) if "experts" in n]
    assert all(m.fp8 is None for n, m in model.named_modules() if n.endswith("experts"))  # type: ignore[union-attr]


def _run_ep2(rank: int, recipes: tuple[str, ...]) -> None:
    st = moe_layout(ep=2)
    cfg = tiny_moe_cfg(seq_len=SEQ)
    every_step = random_steps(cfg, STEPS, MICRO * st.dp)  # one micro-batch per rank (module doc)
    train = tiny_train_cfg(STEPS, clip_grad=0.0)
    for recipe in recipes:
        settings = Fp8Settings(recipe, MIN_DIM)  # type: ignore[arg-type]
        ref = GPT(cfg, ParallelState(), seed=5)
        assert sum(n.endswith("experts") for n in enable_fp8([ref], settings, ParallelState())) == cfg.num_layers
        ref_opt = build_distributed_optimizer(ref, ParallelState(), 0, dtype=torch.float32, optimizer=ADAMW)
        ref_ctx = StepContext.build(ref, ParallelState(), torch.float32, train, LossScaler(False))
        want = [train_step(ref_ctx, ref_opt, micro_batches(d, MICRO), i) for i, d in enumerate(every_step)]
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
        enable_fp8(engine.chunks, settings, st)
        model = engine.chunks[0]
        opt = build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
        ctx = StepContext.build(engine, st, torch.float32, train, LossScaler(False))
        got = [train_step(ctx, opt, _local_batches(d, st), i) for i, d in enumerate(every_step)]
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.loss == b.loss, f"{recipe} ep2: step {i} loss {a.loss} != {b.loss}"
            # Of the same gradients, but summed in another order (round-off; only reported: clipping is off).
            assert abs(a.grad_norm - b.grad_norm) <= 1e-6 * b.grad_norm, f"{recipe} ep2: step {i} grad norm"
        specs, ref_params = named_param_specs(model, ConfigError), ref_opt.full_parameters()
        for name, value in opt.full_parameters().items():
            w = ref_params[name]
            if specs[name].grads == EXPERT_PARALLEL:  # this rank's experts are a block of the reference's
                k = w.shape[0] // 2
                w = w[st.rank_in("ep") * k:(st.rank_in("ep") + 1) * k]
            assert torch.equal(unshard(value, specs[name].layout, st), w), f"{recipe} ep2: {name} after {STEPS} steps"


def test_fp8_experts_at_ep2_match_single_process(dist_world) -> None:
    dist_world(2).run(_run_ep2, ("tensorwise", "rowwise"))


def test_block_recipe_experts_at_ep2_match_single_process(dist_world) -> None:
    """The block recipes (megalite/fp8/blocks.py) keep the expert scales layout-free too (per token along the
    channels, weight blocks within an expert): the same bitwise equality."""
    dist_world(2).run(_run_ep2, ("blockwise", "mxfp8"))


def test_the_estimate_counts_the_fp8_modules_enable_fp8_selects(capsys) -> None:
    """megalite/perfmodel/fp8_moe.py: the same module names as `enable_fp8` on a MoE model with a dense first layer
    and shared experts, at filters that select all, some and none of them; the FLOPs share, the amax bytes and the
    weight copy against a hand count."""
    from megalite.perfmodel.fp8_moe import moe_fp8_estimate
    from megalite.perfmodel.inputs import Layout
    from tools.estimate import main

    # hidden 32, 8 heads of 4 (q 32, k and v 16), 3 layers: layer 0 dense (ffn 64), 1 and 2 MoE (4 experts of 32,
    # top-2, one shared expert of 48).
    cfg = tiny_moe_cfg(seq_len=SEQ, num_layers=3, moe_first_dense=1, moe_shared_experts=1,
                       moe_shared_ffn_hidden_size=48)
    for min_dim in (16, 32, 33):  # 16: all; 32: all but attn.qkv (its 16-row k and v); 33: none (hidden 32)
        chosen = enable_fp8([GPT(cfg, ParallelState(), seed=5)], Fp8Settings("rowwise", min_dim), ParallelState())
        est = moe_fp8_estimate(cfg, Layout(), 1, "rowwise", min_dim)
        assert sorted(est.fp8_modules) == sorted(chosen), (min_dim, est.fp8_modules, chosen)
    assert len(chosen) == 0 and est.fp8_flops_fraction == 0
    # Hand count per token, min dim 32. Matmul weights a token uses: attention 3 x (32 x 64 + 32 x 32) = 9216, the
    # dense MLP 3 x 32 x 64 = 6144, per MoE layer its router 4 x 32, 2 experts x 3 x 32 x 32 and the shared expert
    # 3 x 32 x 48: 37120 with both; the head 61 x 32 = 1952; attention core L H Q s = 3 x 8 x 4 x 16 = 1536.
    hardware = 6 * (37120 + 1952) + 12 * 1536
    # FP8: attn.out 6 x 1024 x 3, the dense MLP 6 x 6144, the experts 4 (fprop + dgrad) x 6144 x 2 layers, the
    # shared experts 6 x 4608 x 2.
    fp8 = 6 * 1024 * 3 + 6 * 6144 + 4 * 6144 * 2 + 6 * 4608 * 2
    est = moe_fp8_estimate(cfg, Layout(), 1, "rowwise", 32)
    assert est.fp8_flops_fraction == pytest.approx(fp8 / hardware) and est.expert_modules == 2
    # Full recompute runs every forward GEMM twice (2 W more, FP8 where the GEMM is): 2 x (1024 x 3 + 6144 + 2 x
    # 6144 + 4608 x 2) FP8; 2 x 37120 + 4 x 1536 in all.
    full = moe_fp8_estimate(cfg, Layout(recompute="full"), 1, "rowwise", 32).fp8_flops_fraction
    assert full == pytest.approx((fp8 + 2 * (3072 + 6144 + 12288 + 9216)) / (hardware + 2 * 37120 + 4 * 1536))
    assert est.weight_copy_bytes == 4 * 64 * 32 and est.amax_bytes == {}  # 4 experts' stacked gate+up in e4m3
    assert moe_fp8_estimate(cfg, Layout(dp=2), 2, "rowwise", 32).weight_copy_bytes == 64 * 32 * 2  # the mlp.up's too
    # tp2 tensorwise: each of the 9 dense FP8 linears makes 3 one-element tp all-reduces (x or g, and W twice),
    # 2 (tp - 1) / tp x 4 bytes each; the experts none.
    assert moe_fp8_estimate(cfg, Layout(tp=2), 1, "tensorwise", 32).amax_bytes == {"tp": 9 * 3 * 4.0}
    assert main(["--preset", "tiny-moe", "--fp8", "rowwise", "--device", "H100", "--ep", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp8 rowwise (min dim 128): 8 modules in FP8, 4 of them routed experts" in out, out
