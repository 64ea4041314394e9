"""What tests/test_layer_pattern_parallel.py runs in its 2 gloo ranks: the tiny gpt-oss-like and Gemma 3-like models
(tests/layer_pattern_utils.py) trained at a layout against the single-process run of the same model."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.fp8.enable import Fp8Settings, enable_fp8
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel import comm
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import StepContext, train_step
from tests.layer_pattern_utils import (gated_cfg, gemma3_cfg, gpt_oss_cfg, hybrid_cfg, hybrid_moe_cfg, kimi_cfg,
                                       nemotron_cfg, perturb)
from tests.moe_utils import moe_layout
from tests.parallel_utils import ADAMW, HYPER, micro_batches, random_steps, tiny_train_cfg
from tests.test_cp_training import LOSS_ATOL, MICRO, M, STEPS, local_batches
from tests.test_fp8_training import GRAD_RTOL, MIN_DIM, PARAM_MAX, PARAM_MEAN

# tests/test_cp_training.py's reasoning (round-off of near-zero gradients through 3 Adam steps), with more room: these
# models bend their round-off harder (soft-caps at 0.5 and 2, a clamp reached at init, q/k norms whose weight
# gradient sums every head, a router whose logits feed a top-k). The first step's gradients agree to ~3e-6 relative
# (measured per parameter at tp2 + sp); after it, measured: gradient norms up to 1.8e-5 relative apart (gemma3 tp2 +
# sp, step 1) and parameters up to 3.1e-4 (gpt-oss tp2 + sp, an embedding row); with the windowed layers on the SDPA
# path (megalite/attention/local.py) 1.36e-3 (gemma3 tp2 + sp, a qkv row: an element whose gradient is near zero,
# which Adam's normalisation turns into an O(lr) step of either sign). A wrong shard, mask or reduction moves
# many parameters by O(lr) = 1e-2 and the first step's norm by far more than 1e-5.
PARAM_ATOL, LATER_NORM_RTOL = 3e-3, 1e-4
VOCAB, EOD = 61, 0
CONFIGS = {"gpt-oss": gpt_oss_cfg, "gemma3": gemma3_cfg, "gated": gated_cfg, "hybrid": hybrid_cfg,
           "hybrid-moe": hybrid_moe_cfg, "nemotron": nemotron_cfg, "kimi": kimi_cfg}


def _reference(cfg: Any, data: list[torch.Tensor], fp8: Fp8Settings | None, context: ContextOptions
               ) -> tuple[GPT, list[tuple[float, float]]]:
    st = ParallelState()
    ref = GPT(cfg, st, seed=5, context=context)
    perturb(ref, st)
    enable_fp8([ref], fp8, st)
    opt = ReferenceOptimizer(ref, st, **HYPER)  # type: ignore[arg-type]
    ctx = StepContext.build(ref, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False))
    return ref, [(r.loss, r.grad_norm) for r in (train_step(ctx, opt, micro_batches(d, MICRO), i)
                                                  for i, d in enumerate(data))]


def _full(value: torch.Tensor, name: str, specs: dict, st: ParallelState) -> torch.Tensor:
    """A parameter gathered over tp (its layout) and over ep (the experts' rows)."""
    spec = specs[name]
    full = unshard(value, spec.layout, st)
    split = spec.grads.split_over
    if split and st.size(split) > 1:
        full = comm.all_gather(full.contiguous(), st, split, dim=0)
    return full


def check_layout(rank: int, kind: str, run: dict[str, Any]) -> Fraction:
    """Train `kind` at the layout `run` gives (tp, pp, sp, zero, ep, pp_layers, fp8 and fp8_min_dim; cp with cp_mode,
    cp_a2a, recompute and `docs`: document masking, token EOD ending about one token in five) and compare each step's
    loss and gradient norm and every parameter after the steps with the single-process run. Returns the bytes this
    rank counted under 'cp' over the training steps."""
    tp, pp, zero, ep, fp8 = run.get("tp", 1), run.get("pp", 1), run.get("zero", 0), run.get("ep", 1), run.get("fp8")
    recipe = Fp8Settings(fp8, run.get("fp8_min_dim", MIN_DIM)) if fp8 else None  # type: ignore[arg-type]
    st = moe_layout(tp=tp, pp=pp, cp=run.get("cp", 1), ep=ep, sp=run.get("sp", False))
    what = f"{kind} {run}"
    cfg = CONFIGS[kind](vocab_size=VOCAB, recompute=run.get("recompute", "none"))
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    eod = EOD if run.get("docs") else None
    if eod is not None:  # documents of random lengths, some shorter than the window, some crossing cp chunks
        data = [torch.where(d % 5 == 0, eod, d) for d in data]
    context = ContextOptions.of(run.get("cp_mode", "ring"), eod, run.get("cp_a2a", 1))
    ref, ref_results = _reference(cfg, data, recipe, context)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            stages=StagePlan(pp_layers=run.get("pp_layers", [])), context=context)
    for chunk in engine.chunks:
        perturb(chunk, st)
    enable_fp8(engine.chunks, recipe, st)
    opt = build_distributed_optimizer(engine.chunks[0], st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False))
    st.counter.reset()
    results = [train_step(ctx, opt, local_batches(d, st), i) for i, d in enumerate(data)]
    cp_bytes = st.counter.exact_bytes("cp")
    for i, (got, (loss, norm)) in enumerate(zip(results, ref_results)):
        # FP8: rounding flips after the first step (tests/test_fp8_training.py)
        rtol = 1e-5 if i == 0 else GRAD_RTOL if fp8 else LATER_NORM_RTOL
        assert abs(got.loss - loss) <= LOSS_ATOL or (fp8 and i), f"{what}: step {i} loss {got.loss} != {loss}"
        assert abs(got.grad_norm - norm) <= rtol * norm, f"{what}: step {i} grad norm {got.grad_norm} != {norm}"
    specs = named_param_specs(engine.chunks[0], ConfigError)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    diffs = {name: (_full(v, name, specs, st) - ref_params[name].detach()).abs()
             for name, v in opt.full_parameters().items()}
    assert diffs and any("layers." in n for n in diffs), what
    worst = max(diffs, key=lambda k: diffs[k].max().item())
    if fp8:
        mean = torch.cat([d.flatten() for d in diffs.values()]).mean().item()
        assert diffs[worst].max() <= PARAM_MAX and mean <= PARAM_MEAN, f"{what}: {worst} off, mean {mean:.2e}"
    else:
        assert diffs[worst].max() <= PARAM_ATOL, f"{what}: {worst} off by {diffs[worst].max():.2e} after {STEPS} steps"
    return cp_bytes
