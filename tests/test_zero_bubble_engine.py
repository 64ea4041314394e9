"""The engine's split backward (B, then W later) for the zero-bubble schedules.

Exactness: W runs the same `_accumulate_wgrad` / dW matmuls as the undeferred backward, per micro-
batch in the same order, so gradients are *bitwise* those of the whole backward (a weight without a
fold, such as gpt2's tied embedding/head at pp=1, gets its gradient in B, as in a whole backward).
Multi-rank parity against the single-process run uses tests/test_pipeline.py's tolerances (losses
1e-5, parameters 1e-4 after 3 AdamW steps); against 1F1B on the same ranks it is bitwise.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn as nn

from megalite.dp.overlap import OverlapSettings
from megalite.layers.linear_fn import DeferredWeightGrads
from megalite.model.gpt import GPT
from megalite.optim import SyncOptions, build_distributed_optimizer
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.pipeline import engine as engine_mod
from megalite.pipeline.engine import run_weight_grads
from megalite.pipeline.schedules import build_schedule
from megalite.training.step import single_stage_engine, train_step
from tests.parallel_utils import (ADAMW, layout, micro_batches, random_steps, reference_optimizer,
                                  step_context, tiny_model_cfg, tiny_train_cfg)

MICRO, STEPS = 2, 3
# Micro-batches per dp rank in the pp x dp=2 runs: 2P at pp=2, P at pp=4 (the least a schedule takes: M >= P;
# test_zero_bubble.py replays the schedules' shapes at every M in [P, 4P+3]).
M = 4


def _main_grads(opt) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 main grad in the gradient sync's buckets, by name (stage 0: whole buckets)."""
    names = opt.sync.names()
    return {names[id(p)]: b.grad_flat[off:off + p.numel()].view(p.shape).clone()
            for b in opt.sync.buckets for p, off in zip(b.params, b.offsets)}


def test_deferred_w_is_a_plain_call_that_completes_the_gradients() -> None:
    """A backward inside `defer_weight_grads` leaves every folded linear's main grad untouched and records
    one call per linear; running the store (the W, a plain function call) then gives the main grads of
    the undeferred backward bitwise, and releases what it held."""
    cfg = tiny_model_cfg("llama", num_layers=2)
    st = ParallelState()
    ids = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    ref = GPT(cfg, st, seed=5)
    ref_opt = build_distributed_optimizer(ref, st, 0, dtype=torch.float32, optimizer=ADAMW)
    ref(ids, ids).mean().backward()
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
    store = DeferredWeightGrads()
    with opt.defer_weight_grads(store):
        model(ids, ids).mean().backward()
    # Every linear of the blocks (qkv, out, up, down) and the head.
    linears = {n for n, _ in model.named_parameters() if n.endswith(("qkv.weight", "out.weight", "up.weight",
                                                                     "down.weight", "head.weight"))}
    assert len(store.work) == 4 * cfg.num_layers + 1
    want, before = _main_grads(ref_opt), _main_grads(opt)
    for name, g in before.items():
        if name in linears:
            assert torch.count_nonzero(g) == 0, f"{name}: a deferred weight gradient arrived in B"
        else:
            assert torch.equal(g, want[name]), name
    run_weight_grads(store)
    assert not store.work  # W released what it held
    after = _main_grads(opt)
    for name, g in want.items():
        assert torch.equal(after[name], g), name


WHOLE = [("F", m, 0) for m in range(4)] + [("B", m, 0) for m in range(4)]
SPLIT = [a for m in range(4) for a in (("F", m, 0), ("B", m, 0))] + [("W", m, 0) for m in range(4)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("zero", [False, True])
def test_split_backward_is_bitwise_the_whole_backward(arch: str, recompute: str, zero: bool) -> None:
    """pp=1, 4 micro-batches: F,B for all then the W's, against whole backwards. With ZeRO (stage 0
    with dp=1) the linears' W adds dW straight into the fp32 main grad (gradient-accumulation fusion)."""
    cfg = tiny_model_cfg(arch, num_layers=2, recompute=recompute)
    st = ParallelState()
    batches = micro_batches(random_steps(cfg, 1, 4 * MICRO)[0], MICRO)
    grads = []
    for actions in (WHOLE, SPLIT):
        model = GPT(cfg, st, seed=5)
        opt = (build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW) if zero
               else reference_optimizer(model, st))
        opt.zero_grad()
        engine = single_stage_engine(model, st, torch.float32)
        engine.run(actions, batches, 1.0, opt)
        opt.finish_grad_sync()
        if zero:
            grads.append({str(i): b.grad_shard.clone() for i, b in enumerate(opt.sync.buckets)})
        else:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert engine.peak_in_flight == 4
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


def _zero_pipeline_cfg(pp: int, arch: str, schedule: str):
    vpp = 2 if schedule == "zbv" else 1
    return tiny_model_cfg(arch, num_layers=max(4, pp * vpp), **({"tie_embeddings": False} if schedule == "zbv" else {}))


@functools.lru_cache(maxsize=None)
def _zero_pipeline_reference(pp: int, arch: str, schedule: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run's losses and parameters (pp x dp=2's global batch), once per case in the pytest
    process: each of the 2·pp ranks would otherwise rerun the same deterministic run (most of the work at pp 4)."""
    cfg = _zero_pipeline_cfg(pp, arch, schedule)
    data = random_steps(cfg, STEPS, MICRO * M * 2)
    ref_state = ParallelState()
    ref = GPT(cfg, ref_state, seed=5)
    ref_opt = reference_optimizer(ref, ref_state)
    ref_ctx = step_context(ref, ref_state, torch.float32, tiny_train_cfg(STEPS))
    losses = [train_step(ref_ctx, ref_opt, micro_batches(d, MICRO), i).loss for i, d in enumerate(data)]
    return losses, {k: v.detach().clone() for k, v in ref.named_parameters(remove_duplicate=False)}


def _run_zero_pipeline(dist_world, pp: int, stage: int, arch: str, schedule: str) -> list[dict]:
    return dist_world(2 * pp).run(_check_zero_pipeline, pp, stage, arch, schedule,
                                  _zero_pipeline_reference(pp, arch, schedule))


def _check_zero_pipeline(rank: int, pp: int, stage: int, arch: str, schedule: str,
                         ref: tuple[list[float], dict[str, torch.Tensor]]) -> dict[str, object]:
    """pp x dp=2 with ZeRO `stage`: the zero-bubble schedule against the single-process run, and (same
    placement) bitwise against 1F1B; records when the DP reductions start."""
    st = layout(1, pp)
    vpp = 2 if schedule == "zbv" else 1
    cfg = _zero_pipeline_cfg(pp, arch, schedule)
    per_rank = MICRO * M
    data = random_steps(cfg, STEPS, per_rank * st.dp)
    tcfg = tiny_train_cfg(STEPS)
    ref_losses, ref_params = ref
    mine = [micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO) for d in data]
    params, timing = {}, []
    for sched in ([schedule, "1f1b"] if schedule == "zb-h1" else [schedule]):
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                                stages=StagePlan(vpp=vpp, schedule=sched))
        model = engine.chunks[0] if vpp == 1 else nn.ModuleList(engine.chunks)
        opt = build_distributed_optimizer(model, st, stage, dtype=torch.float32, optimizer=ADAMW,
                                      sync=SyncOptions(OverlapSettings(bucket_bytes=8192)))
        real_w = engine_mod.run_weight_grads

        def watched_w(store):  # which W's start a DP reduction
            before = st.counter.by_op().get("dp/all_reduce", 0) + st.counter.by_op().get("dp/reduce_scatter", 0)
            real_w(store)
            after = st.counter.by_op().get("dp/all_reduce", 0) + st.counter.by_op().get("dp/reduce_scatter", 0)
            timing.append((after > before, all(b.launched for b in opt.sync.buckets)))

        engine_mod.run_weight_grads = watched_w
        try:
            ctx = step_context(engine, st, torch.float32, tcfg, sched)
            losses = [train_step(ctx, opt, b, i).loss for i, b in enumerate(mine)]
        finally:
            engine_mod.run_weight_grads = real_w
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5, f"{sched} zero={stage} step {i}: loss {a} != reference {b}"
        params[sched] = opt.full_parameters()
        peak = engine.peak_in_flight
    for name, value in params[schedule].items():
        name = re.sub(r"^\d+\.", "", name)  # the chunk index of an nn.ModuleList of chunks (zbv)
        expect = ref_params[name]
        if name.endswith("attn.qkv.bias"):  # see tests/test_tensor_parallel.py: the key bias has no gradient
            h = cfg.hidden_size
            value, expect = torch.cat([value[:h], value[-h:]]), torch.cat([expect[:h], expect[-h:]])
        assert (value - expect).abs().max().item() <= 1e-4, f"{schedule} zero={stage}: {name}"
    if "1f1b" in params:
        for name, value in params["1f1b"].items():
            assert torch.equal(params[schedule][name], value), f"zb-h1 != 1f1b bitwise: {name}"
    ws = [c for kind, _, c in build_schedule(schedule, M, pp, st.pp_rank, vpp) if kind == "W"]
    last_w = min(max(i for i, c in enumerate(ws) if c == chunk) for chunk in range(vpp))  # a chunk's last W, first
    return {"timing": timing[:STEPS * len(engine.chunks) * M], "peak": peak, "first_last_w": last_w}


@pytest.mark.parametrize("pp,stage,arch,schedule", [
    (2, 0, "gpt2", "zb-h1"), (2, 1, "gpt2", "zb-h1"), (2, 2, "gpt2", "zb-h1"), (2, 3, "llama", "zb-h1"),
    (2, 0, "llama", "zbv"), (2, 1, "llama", "zbv"), (2, 2, "gpt2", "zbv"),
])
def test_zero_bubble_with_zero_matches_single_process(dist_world, pp: int, stage: int, arch: str,
                                                      schedule: str) -> None:
    _assert_reductions_start_in_last_w(_run_zero_pipeline(dist_world, pp, stage, arch, schedule), schedule, m=M)


def _assert_reductions_start_in_last_w(out: list[dict], schedule: str, m: int) -> None:
    for rank_out in out:
        timing = rank_out["timing"]
        if schedule == "zb-h1":
            # One chunk per rank, M W's per step: only the step's last W starts DP reductions, and by
            # its end every bucket's reduction is under way (overlapped with the rest of that W).
            per_step = [timing[i * m:(i + 1) * m] for i in range(STEPS)]
            for w in per_step:
                assert [started for started, _ in w] == [False] * (m - 1) + [True], w
                assert w[-1][1], "a bucket's reduction waited for finish_grad_sync"
        else:  # zbv: no reduction before a chunk's last W (buckets spanning both chunks start later)
            per_step = [timing[i * 2 * m:(i + 1) * 2 * m] for i in range(STEPS)]
            for w in per_step:
                first = next(i for i, (started, _) in enumerate(w) if started)
                # The rank's schedule says where a chunk's M W's first end (the M-th W at the earliest: at
                # M = P rank 0 runs all of chunk 1's W's first).
                assert first >= rank_out["first_last_w"] >= m - 1, w


@pytest.mark.parametrize("schedule,stage", [("zbv", 1), ("zb-h1", 3)])
def test_zero_bubble_at_pp4(dist_world, schedule: str, stage: int) -> None:
    """pp=4 x dp=2 on 8 ranks: middle ranks, whose W's fall between their neighbours'. zb-h1 at ZeRO 3 (sharded
    parameters and gradients on top of stage 1's sharded optimizer); ZeRO 1 with zb-h1 is the pp=2 case above."""
    out = _run_zero_pipeline(dist_world, 4, stage, "llama", schedule)
    _assert_reductions_start_in_last_w(out, schedule, m=M)


def test_pretrain_zbv_trains_like_one_process(dist_world, demo_cache_dir: str, tmp_path) -> None:
    """pretrain.py at 2 ranks (in the warm pool: tests/pool_pretrain.py), pp=2 with zbv (the trainer must build
    the V placement): the same losses as one process (fp32; pp-only runs the same ops: 1e-5 on O(1) losses)."""
    from megalite.training.trainer import main
    from tests.pool_pretrain import run_pretrain_in_pool
    from tests.test_pretrain import _args, _losses

    common = ["--train.steps", "3", "--model.arch", "llama", "--model.num_layers", "4",
              "--train.global_batch_size", "16"]
    assert main(_args(demo_cache_dir, tmp_path / "one", *common)) == 0
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, tmp_path / "zbv", *common, "--parallel.pp", "2",
                                                  "--parallel.vpp", "2", "--parallel.schedule", "zbv"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, zbv = _losses(tmp_path / "one"), _losses(tmp_path / "zbv")
    assert one.keys() == zbv.keys()
    for step in one:
        assert abs(one[step] - zbv[step]) < 1e-5, f"step {step}: zbv loss {zbv[step]} != {one[step]}"
