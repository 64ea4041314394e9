"""Expert parallelism (and MoE under tp/sp, cp, pp, ZeRO) against the single-process run: losses, gradient
norms and every parameter after several AdamW steps, and the 'ep' bytes against the estimator given the
run's measured routing (gloo ranks, fp32).

Tolerances as in tests/test_cp_training.py (its module doc): the distributed run adds the same terms in
another order (the expert gradient is summed over the ep ranks in the all-to-all's backward and over edp
in the optimizer, then averaged over dp x cp), so losses agree to 1e-5 absolute, norms to 1e-5 relative,
and parameters after 3 steps at lr 1e-2 to 1e-4 (Adam turns the ~1e-7 round-off of a near-zero gradient into
~1e-5; a wrong scaling or a misrouted token moves parameters by O(lr)). Dividing the expert gradients by
edp instead of dp x cp fails the norm check (factor ep).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megalite.data.sampler import cp_split
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.moe.costs import a2a_bytes_measured
from megalite.moe.step_metrics import moe_layers_of
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.moe.costs import a2a_bytes_measured
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import ADAMW, HYPER, micro_batches, random_steps, tiny_train_cfg

STEPS, MICRO, M, SEQ = 3, 2, 2, 16
LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-4


def _local_batches(data: torch.Tensor, st: ParallelState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    per_rank = data.shape[0] // st.dp
    rows = data[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank]
    return [(cp_split(i, st.cp, st.cp_rank), cp_split(t, st.cp, st.cp_rank)) for i, t in micro_batches(rows, MICRO)]


def _biased(model: nn.Module, bias: list[float] | None) -> None:
    """Fix DeepSeek routers' selection bias (e.g. so that some experts never receive a token)."""
    if bias is None:
        return
    for name, buf in model.named_buffers():
        if name.endswith("router.bias"):
            buf.copy_(torch.tensor(bias))


def _reference(cfg, data: list[torch.Tensor], bias: list[float] | None):
    st = ParallelState()
    ref = GPT(cfg, st, seed=5)
    _biased(ref, bias)
    opt = ReferenceOptimizer(ref, st, **HYPER)
    ctx = StepContext.build(ref, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False))
    results = [train_step(ctx, opt, micro_batches(d, MICRO), i) for i, d in enumerate(data)]
    return ref, results


def _check(rank: int, tp: int, cp: int, pp: int, sp: bool, zero: int, ep: int, router: str = "qwen3",
           schedule: str = "1f1b", recompute: str = "none", bias: list[float] | None = None,
           arch: str = "llama", **moe: object) -> dict:
    st = moe_layout(tp, pp, cp, ep, sp)
    what = f"tp={tp} cp={cp} pp={pp} dp={st.dp} ep={ep} sp={sp} zero={zero} {router} {schedule} {recompute}"
    cfg = tiny_moe_cfg(arch, seq_len=SEQ, num_layers=2 * pp, moe_router=router, recompute=recompute, **moe)
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    ref, ref_results = _reference(cfg, data, bias)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            stages=StagePlan(schedule=schedule))
    model = engine.chunks[0]
    _biased(model, bias)
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False), schedule)
    st.counter.reset()
    results = [train_step(ctx, opt, _local_batches(d, st), i) for i, d in enumerate(data)]
    for i, (got, want) in enumerate(zip(results, ref_results)):
        assert abs(got.loss - want.loss) <= LOSS_ATOL, f"{what}: step {i} loss {got.loss} != {want.loss}"
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm, \
            f"{what}: step {i} grad norm {got.grad_norm} != {want.grad_norm}"
        # The loads are global: the same numbers as one process's, every layer's on every rank (pp: each
        # stage reports the other stages' layers too, so rank 0's metrics.jsonl has them all).
        assert got.moe is not None and set(got.moe["load_max"]) == set(want.moe["load_max"]), f"{what}: layers"
        for name, v in want.moe["load_max"].items():
            assert got.moe["load_max"][name] == v, f"{what}: step {i} {name} load {got.moe['load_max']}"
        for name, v in want.moe["aux_loss"].items():
            assert abs(got.moe["aux_loss"][name] - v) <= 1e-6, f"{what}: step {i} {name} aux"
    ref_params = dict(ref.named_parameters())
    specs = named_param_specs(model, ConfigError)
    local = st.size("ep")
    for name, value in opt.full_parameters().items():
        spec = specs[name]
        want = ref_params[name].detach()
        if spec.grads == EXPERT_PARALLEL:  # this rank's experts are a block of the reference's
            n = want.shape[0] // local
            want = want[st.rank_in("ep") * n:(st.rank_in("ep") + 1) * n]
        got = unshard(value, spec.layout, st)
        err = (got - want).abs().max().item()
        assert err <= PARAM_ATOL, f"{what}: parameter {name} off by {err:.2e} after {STEPS} steps"
    for name, buf in model.named_buffers():  # DeepSeek's bias follows the global loads
        if name.endswith("router.bias"):
            assert torch.equal(buf, dict(ref.named_buffers())[name]), f"{what}: {name}"
    # 'ep' holds exactly the dispatch/combine traffic the measured routing implies (perfmodel.moe).
    mine = {name for name, _ in moe_layers_of([model])}  # this stage's layers: the exchanges this rank ran
    rows = sum(v for r in results if r.moe for n, v in r.moe["a2a_rows"].items() if n in mine)
    calls = sum(v for r in results if r.moe for n, v in r.moe["a2a_calls"].items() if n in mine)
    expected = a2a_bytes_measured(rows, calls, ep, cfg.moe.experts, cfg.hidden_size, 4,
                                  2 if recompute == "full" else 1)
    got_bytes = st.counter.exact_bytes("ep")
    assert got_bytes == expected, f"{what}: ep bytes {got_bytes} != estimate {expected}"
    return {"rows": rows, "ep_bytes": float(got_bytes)}


def _check_world2(rank: int) -> list[dict]:
    """ep2 alone, then DeepSeek's bias sending every token to experts 0 and 1, both on ep rank 0: rank 1's
    experts receive nothing, every step (a normal case: its gradients are zero, the exchange has empty
    splits). One task, so the two cases share the world's start."""
    return [_check(rank, 1, 1, 1, False, 0, 2),
            _check(rank, 1, 1, 1, False, 0, 2, "deepseek", bias=[10.0, 10.0, 0.0, 0.0])]


def test_ep2_alone_and_a_rank_with_no_tokens(dist_world) -> None:
    out = dist_world(2).run(_check_world2)
    # Every rank exchanged rows in both cases (rank 1 sent its tokens to rank 0 and got their outputs back).
    assert all(case["rows"] > 0 for rank in out for case in rank)


CASES = [  # tp, cp, pp, sp, zero, ep, router, schedule, recompute: one world of 4 ranks, one case per composition
    (1, 1, 1, False, 1, 4, "mixtral", "1f1b", "none"),  # ep4 (edp 1) with ZeRO-1: dense states over dp 4
    (2, 1, 1, True, 2, 2, "qwen3", "1f1b", "none"),     # tp2 + sp with ep2 (dp 2, edp 1), ZeRO-2
    (1, 2, 1, False, 2, 2, "qwen3", "1f1b", "none"),    # cp2 x ep2 (ep from the cp ranks), ZeRO-2: experts over edp 2
    (1, 1, 2, False, 0, 2, "mixtral", "zb-h1", "none"),  # pp2 ZB-H1 (split backward) x ep2
    # pp2 1F1B x ep2 under full recompute: the exchanges run again in the backward (2 forward passes of bytes)
    # and the recomputed forward must not count its loads twice
    (1, 1, 2, False, 1, 2, "qwen3", "1f1b", "full"),
    (1, 1, 1, False, 3, 2, "qwen3", "1f1b", "none"),    # dp4 x ep2, ZeRO-3: experts' params and states over edp 2
]


@pytest.mark.parametrize("tp,cp,pp,sp,zero,ep,router,schedule,recompute", CASES)
def test_ep_composes(dist_world, tp, cp, pp, sp, zero, ep, router, schedule, recompute) -> None:
    dist_world(4).run(_check, tp, cp, pp, sp, zero, ep, router, schedule, recompute)
