"""FP8 expert GEMMs (megalite/layers/fp8_experts.py): against a plain-torch emulation to the bit, the filter
on the experts, and a whole ep2 run against the single-process run for both recipes.

Bitwise: as in tests/test_fp8.py's module doc (CPU `_scaled_mm` dequantizes and multiplies in fp32, the
scales are powers of two, and the emulation computes its scales independently with a float64 log2).

The ep2 run: expert parallelism sends the rows of two ranks' micro-batches to one expert, which the single-
process run meets one micro-batch at a time; the expert scales are per token and per weight only (an expert's
output rows do not depend on the other rows it gets: checked bitwise below), so the two quantize the same
values. Tolerances: tests/test_fp8_training.py's (round-off; rowwise observed: parameters 1e-9 apart on average
after 3 steps). Tensorwise is compared over one step: from step 1 on its two runs part (the loss 1.3e-5 apart at
step 1, layer 0's parameters ~3e-4 apart on average after step 3) while rowwise and the non-FP8 runs stay at
round-off. Step 0 agrees exactly, so we attribute it to tensorwise's one scale per tensor: a round-off change of
an amax lying at a power of two moves the scale of the whole tensor (not traced to the tensor here).
"""

from __future__ import annotations

import pytest
import torch

from megalite.errors import ConfigError
from megalite.layers.fp8 import Fp8Settings, enable_fp8
from megalite.layers.fp8_experts import Fp8ExpertGemm
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.adamw import LossScaler
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import HYPER, micro_batches, random_steps, tiny_train_cfg
from tests.test_fp8 import E4M3, _emulate_q
from tests.test_fp8_training import GRAD_RTOL, MIN_DIM, PARAM_MAX, PARAM_MEAN
from tests.test_moe_ep import LOSS_ATOL, MICRO, SEQ, STEPS, _local_batches

COUNTS = [5, 0, 1, 10]  # an expert without rows and one with a single row
RECIPE_STEPS = {"tensorwise": 1, "rowwise": STEPS}  # module doc


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


def test_the_filter_on_the_experts() -> None:
    cfg = tiny_moe_cfg(seq_len=SEQ)  # hidden 32, expert ffn 32
    chosen = enable_fp8([GPT(cfg, ParallelState(), seed=5)], Fp8Settings("rowwise", 32), ParallelState())
    assert {n for n in chosen if n.endswith("experts")} == {"layers.0.mlp.experts", "layers.1.mlp.experts"}, chosen
    model = GPT(cfg, ParallelState(), seed=5)
    assert not [n for n in enable_fp8([model], Fp8Settings("rowwise", 33), ParallelState()) if "experts" in n]
    assert all(m.fp8 is None for n, m in model.named_modules() if n.endswith("experts"))  # type: ignore[union-attr]


def _run_ep2(rank: int) -> None:
    st = moe_layout(ep=2)
    cfg = tiny_moe_cfg(seq_len=SEQ)
    every_step = random_steps(cfg, STEPS, MICRO * 2 * st.dp)
    for recipe, steps in RECIPE_STEPS.items():
        data = every_step[:steps]
        settings = Fp8Settings(recipe, MIN_DIM)  # type: ignore[arg-type]
        ref = GPT(cfg, ParallelState(), seed=5)
        assert sum(n.endswith("experts") for n in enable_fp8([ref], settings, ParallelState())) == cfg.num_layers
        ref_opt = ReferenceOptimizer(ref, ParallelState(), **HYPER)
        ref_ctx = StepContext.build(ref, ParallelState(), torch.float32, tiny_train_cfg(steps), LossScaler(False))
        want = [train_step(ref_ctx, ref_opt, micro_batches(d, MICRO), i) for i, d in enumerate(data)]
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
        enable_fp8(engine.chunks, settings, st)
        model = engine.chunks[0]
        opt = build_distributed_optimizer(model, st, 0, dtype=torch.float32, **HYPER)
        ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(steps), LossScaler(False))
        got = [train_step(ctx, opt, _local_batches(d, st), i) for i, d in enumerate(data)]
        for i, (a, b) in enumerate(zip(got, want)):
            assert abs(a.loss - b.loss) <= LOSS_ATOL, f"{recipe} ep2: step {i} loss {a.loss} != {b.loss}"
            rtol = 1e-5 if i == 0 else GRAD_RTOL
            assert abs(a.grad_norm - b.grad_norm) <= rtol * b.grad_norm, f"{recipe} ep2: step {i} grad norm"
        specs, ref_params = named_param_specs(model, ConfigError), dict(ref.named_parameters())
        diffs = []
        for name, value in opt.full_parameters().items():
            w = ref_params[name].detach()
            if specs[name].grad_group == "edp":  # this rank's experts are a block of the reference's
                k = w.shape[0] // 2
                w = w[st.rank_in("ep") * k:(st.rank_in("ep") + 1) * k]
            diffs.append((unshard(value, specs[name].layout, st) - w).abs().flatten())
        every = torch.cat(diffs)
        assert every.max() <= PARAM_MAX and every.mean() <= PARAM_MEAN, \
            f"{recipe} ep2: parameters off by {every.mean():.2e} on average, {every.max():.2e} at most after {steps} steps"


def test_fp8_experts_at_ep2_match_single_process(dist_world) -> None:
    dist_world(2).run(_run_ep2)
