"""ZeRO stages 0-3 against the single-process run, and their exact memory and communication.

Tolerances (fp32): the sharded run computes the same forward, but each DP rank sums its own
micro-batches' gradients and the DP reduction adds the ranks' sums in another order, so gradients
differ from the reference by O(eps_fp32 * |g|) ~ 1e-8 relative. Losses agree to 1e-5 absolute (O(1)
values, 3 steps). AdamW divides by sqrt(v): for the tiniest gradients that turns round-off into
relative differences of the update, so parameters (size ~0.02-1, lr 1e-2) are compared to 1e-4 (the
reference's tp=1 loss also uses torch's fused cross-entropy, another summation order) — any
real error (a missing shard, a double-counted reduction, a wrong average) moves them by >= 1e-3.
The key bias of gpt2 has a true gradient of 0 (softmax is shift-invariant), so Adam amplifies pure
round-off there into O(lr) steps: it is excluded, as in test_tensor_parallel.

Memory and DP bytes are integers/fractions and are asserted exactly against the formulas in
`megalite.optim.zero` (padding included: each bucket is padded up to a multiple of dp).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megalite.dp.overlap import OverlapSettings
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.optim import SyncOptions, build_distributed_optimizer
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.training.step import evaluate, train_step
from tests.parallel_utils import (ADAMW, layout, micro_batches, random_steps, reference_optimizer,
                                  step_context, tiny_model_cfg, tiny_train_cfg)

# 3 optimizer steps (losses compared before the first update and after the first and the second) of M
# micro-batches of MICRO sequences per DP rank.
STEPS, MICRO, M = 3, 2, 2


def _pad(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def expected_memory(stage: int, psi: int, padded: int, dp: int, b: int) -> dict[str, int]:
    """The table in `megalite.optim.zero` (b = param bytes; fp32 params are their own master)."""
    p = psi if stage == 0 else padded
    shard = p if stage == 0 else p // dp
    return {"params": b * (shard if stage == 3 else p), "grads": 4 * (p if stage <= 1 else shard),
            "master": 0 if b == 4 else 4 * shard, "optimizer": 8 * shard}


def expected_dp_bytes(stage: int, psi: int, padded: int, dp: int, b: int, micro_batches: int) -> Fraction:
    """Wire bytes per step over dp: grads reduced in fp32, params gathered in their dtype."""
    ring = Fraction(dp - 1, dp)
    if stage == 0:
        return 2 * ring * 4 * psi
    if stage in (1, 2):
        return ring * (4 * padded + b * padded)
    return ring * (2 * micro_batches * b * padded + 4 * padded)


def _padded_size(model: GPT, stage: int, dp: int) -> tuple[int, int]:
    """(Psi, P): Psi = this rank's unique parameter elements; P padded per bucket (one 25 MB bucket at
    stages 1-2; one unit per block plus one for everything else at stage 3)."""
    uniq = {id(p): p for p in model.parameters()}
    psi = sum(p.numel() for p in uniq.values())
    if stage < 3:
        return psi, _pad(psi, dp)
    blocks = [sum(p.numel() for p in blk.parameters()) for blk in model.layers.values()]
    return psi, sum(_pad(n, dp) for n in blocks) + _pad(psi - sum(blocks), dp)


def _check_parity(rank: int, tp: int, sp: bool, stages: list[int], arch: str,
                  recompute: str = "none") -> list[dict[str, int]]:
    """Every stage in `stages` against one single-process reference run (built once: it is the same for
    all stages of a layout), with its exact dp bytes and memory; returns each stage's memory table."""
    st = layout(tp, sp=sp)
    cfg = tiny_model_cfg(arch, recompute=recompute)
    global_batch = MICRO * M * st.dp
    data = random_steps(cfg, STEPS, global_batch)
    ref_state = ParallelState()
    ref = GPT(cfg, ref_state, seed=5)
    ref_opt = reference_optimizer(ref, ref_state)
    tcfg = tiny_train_cfg(STEPS)
    ref_losses = [train_step(step_context(ref, ref_state, torch.float32, tcfg),
                             ref_opt, micro_batches(d, MICRO), i).loss
                  for i, d in enumerate(data)]
    val = micro_batches(data[0][:MICRO * 2], MICRO)
    ref_eval = evaluate(ref, val, ref_state, torch.float32)
    return [_check_stage(st, cfg, stage, data, ref, ref_losses, ref_eval, val) for stage in stages]


def _check_stage(st: ParallelState, cfg, stage: int, data: list[torch.Tensor], ref: GPT, ref_losses: list[float],
                 ref_eval: float, val: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    tcfg = tiny_train_cfg(STEPS)
    global_batch = MICRO * M * st.dp
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, stage, dtype=torch.float32, optimizer=ADAMW)
    per_rank = global_batch // st.dp
    st.counter.reset()
    losses = [train_step(step_context(model, st, torch.float32, tcfg),
                         opt, micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO), i).loss
              for i, d in enumerate(data)]
    measured_dp = st.counter.exact_bytes("dp")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5, f"zero={stage} step {i}: loss {a} != reference {b}"
    psi, padded = _padded_size(model, stage, st.dp)
    expected = expected_dp_bytes(stage, psi, padded, st.dp, 4, M) * STEPS
    assert measured_dp == expected, f"zero={stage}: dp bytes {measured_dp} != formula {expected}"
    mem = opt.memory_bytes()
    assert mem == expected_memory(stage, psi, padded, st.dp, 4), f"zero={stage}: memory {mem}"
    params = dict(model.named_parameters())
    specs = named_param_specs(model, ConfigError)
    ref_params = dict(ref.named_parameters())
    for name, value in opt.full_parameters().items():
        full, expect = unshard(value, specs[name].layout, st), ref_params[name].detach()
        if name.endswith("attn.qkv.bias"):  # zero true gradient (see module doc): compare q and v only
            h = cfg.hidden_size
            full, expect = torch.cat([full[:h], full[-h:]]), torch.cat([expect[:h], expect[-h:]])
        err = (full - expect).abs().max().item()
        assert err <= 1e-4, f"zero={stage}: parameter {name} off by {err:.2e} after {STEPS} steps"
        if stage < 3:  # the model's own params hold the updated values (stage 3: only shards)
            assert torch.equal(params[name].detach(), value), name
    # Evaluation (no grad) gathers and frees stage-3 units too; same round-off budget as the losses.
    got = evaluate(model, val, st, torch.float32)
    assert abs(got - ref_eval) <= 1e-5, f"zero={stage}: eval loss {got} != {ref_eval}"
    if stage == 3:
        _check_gather_buffers_are_reused(opt.sync.zero3)
    return mem


def _check_gather_buffers_are_reused(z3) -> None:
    """After the steps every unit is freed, and the gathers drew on fixed buffers: one per unit gathered at once
    (the outer unit, the block computing and `prefetch` ahead), whatever the number of blocks and steps."""
    assert z3 is not None and all(not z3.is_gathered(b) for b in z3.units())
    at_once = len(z3.outer[1] if z3.outer else []) + (1 + z3.prefetch) * max(len(bs) for _, bs in z3.blocks)
    idle = [buf for bufs in z3.buffers._idle.values() for buf in bufs]
    assert 0 < len(idle) <= at_once, (len(idle), at_once)
    ptrs = {buf.data_ptr() for buf in idle}
    z3.gather_unit(z3.blocks[0][1])  # a gather takes one of them: no new allocation
    assert z3.blocks[0][1][0].param_flat.data_ptr() in ptrs
    z3.free_all()


@pytest.mark.parametrize("world,tp,sp,arch", [(2, 1, False, "gpt2"), (4, 1, False, "llama"), (4, 2, True, "gpt2")])
def test_zero_matches_single_process(dist_world, world: int, tp: int, sp: bool, arch: str) -> None:
    """Stages 0-3 in one run per layout: they share the reference run, which dominated when each stage ran alone."""
    per_rank = dist_world(world).run(_check_parity, tp, sp, [0, 1, 2, 3], arch)
    for stage in (1, 2, 3):  # something really is sharded: optimizer state is 1/dp of the replicated one
        assert all(m[stage]["optimizer"] == per_rank[0][stage]["optimizer"] for m in per_rank), stage


def test_zero3_with_full_recompute(dist_world) -> None:
    """Full recompute reruns each block's forward inside the backward: the stage-3 hooks must neither
    free the unit nor prefetch during that rerun, or the recomputed activations use freed weights."""
    dist_world(2).run(_check_parity, 1, False, [3], "llama", "full")


def _check_mixed_precision_accounting(rank: int, dtype: torch.dtype) -> None:
    """bf16/fp16 params with fp32 master, grads and Adam: memory and dp bytes for every stage."""
    st = layout(1)
    cfg = tiny_model_cfg("llama")
    data = random_steps(cfg, 1, MICRO * M)
    for stage in range(4):
        model = GPT(cfg, st, seed=5)
        opt = build_distributed_optimizer(model, st, stage, dtype=dtype, optimizer=ADAMW)
        assert all(p.dtype == dtype for p in model.parameters()) or stage == 3
        st.counter.reset()
        res = train_step(step_context(model, st, dtype, tiny_train_cfg(1)),
                         opt, micro_batches(data[0], MICRO), 0)
        assert res.loss == res.loss and not res.skipped, f"zero={stage}: loss {res.loss}"
        psi, padded = _padded_size(model, stage, st.dp)
        assert opt.memory_bytes() == expected_memory(stage, psi, padded, st.dp, 2), f"zero={stage} {dtype}"
        assert st.counter.exact_bytes("dp") == expected_dp_bytes(stage, psi, padded, st.dp, 2, M), stage
        if stage > 0:
            assert all(s.master.dtype == torch.float32 for s in opt.optimizer.states)


def test_mixed_precision_memory_and_bytes(dist_world) -> None:
    dist_world(2).run(_check_mixed_precision_accounting, torch.bfloat16)


def _check_reductions_only_in_last_micro_batch(rank: int, stage: int) -> list[int]:
    """4 micro-batches, small buckets: no dp reduction before the last backward, and every bucket's
    reduction has started before `finish_grad_sync` (overlapped with the backward)."""
    st = layout(1)
    cfg = tiny_model_cfg("gpt2")
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, stage, dtype=torch.float32, optimizer=ADAMW,
                                      sync=SyncOptions(OverlapSettings(bucket_bytes=8192)))
    batches = micro_batches(random_steps(cfg, 1, 4 * MICRO)[0], MICRO)
    opt.zero_grad()
    st.counter.reset()
    reductions = []
    for i, (ids, labels) in enumerate(batches):
        ctx = opt.no_sync() if i < len(batches) - 1 else torch.enable_grad()
        with ctx:
            (model(ids, labels).mean() / len(batches)).backward()
        ops = st.counter.by_op()
        reductions.append(sum(1 for k in ("dp/all_reduce", "dp/reduce_scatter") if ops.get(k, 0) > 0))
    assert reductions[:-1] == [0, 0, 0], f"zero={stage}: dp reduction inside no_sync: {reductions}"
    assert reductions[-1] == 1
    assert all(b.launched for b in opt.sync.buckets), "a bucket's reduction waited for finish_grad_sync"
    opt.finish_grad_sync()
    return [len(opt.sync.buckets)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reductions_only_in_last_micro_batch(dist_world, stage: int) -> None:
    n_buckets = dist_world(2).run(_check_reductions_only_in_last_micro_batch, stage)[0][0]
    assert n_buckets > 1  # the small bucket size really produced several buckets


def _check_dp1_fallback(rank: int) -> None:
    st = ParallelState()
    model = GPT(tiny_model_cfg("llama"), st, seed=5)
    with pytest.warns(UserWarning, match="nothing to shard"):
        opt = build_distributed_optimizer(model, st, 2, dtype=torch.float32, optimizer=ADAMW)
    assert opt.stage == 0


def test_zero_with_dp1_falls_back_to_stage0() -> None:
    _check_dp1_fallback(0)


def _check_state_roundtrip(rank: int, stage: int) -> None:
    """Resume from `param_states()` (what a checkpoint saves: fp32 masters and moments) into a fresh
    model+optimizer, whose parameters the masters then overwrite: the next step is identical."""
    st = layout(1)
    cfg = tiny_model_cfg("llama")
    data = random_steps(cfg, 3, MICRO * 2 * st.dp)
    per_rank = MICRO * 2
    mine = [micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO) for d in data]
    tcfg = tiny_train_cfg(3)
    models, opts = [], []
    for _ in range(2):
        models.append(GPT(cfg, st, seed=5))
        opts.append(build_distributed_optimizer(models[-1], st, stage, dtype=torch.bfloat16, optimizer=ADAMW))
    for i in range(2):
        train_step(step_context(models[0], st, torch.bfloat16, tcfg), opts[0], mine[i], i)
    opts[1].load_param_states(opts[0].param_states())
    a = train_step(step_context(models[0], st, torch.bfloat16, tcfg), opts[0], mine[2], 2)
    b = train_step(step_context(models[1], st, torch.bfloat16, tcfg), opts[1], mine[2], 2)
    assert a.loss == b.loss and a.grad_norm == b.grad_norm, (a, b)
    fa, fb = opts[0].full_parameters(), opts[1].full_parameters()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.mark.parametrize("stage", [1, 3])
def test_param_states_resume_exactly(dist_world, stage: int) -> None:
    dist_world(2).run(_check_state_roundtrip, stage)


def _check_pipeline(rank: int, stages: list[int], arch: str) -> None:
    """pp=2 x dp=2 (1F1B, 4 micro-batches): the pipeline engine only calls no_sync/finish_grad_sync.
    Each stage in `stages` is checked against the one reference run."""
    from megalite.pipeline import build_pipeline

    st = layout(1, 2)
    cfg = tiny_model_cfg(arch, num_layers=4)
    per_rank = MICRO * 4
    data = random_steps(cfg, 3, per_rank * st.dp)
    ref_state = ParallelState()
    ref = GPT(cfg, ref_state, seed=5)
    ref_opt = reference_optimizer(ref, ref_state)
    tcfg = tiny_train_cfg(3)
    ref_losses = [train_step(step_context(ref, ref_state, torch.float32, tcfg),
                             ref_opt, micro_batches(d, MICRO), i).loss
                  for i, d in enumerate(data)]
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for stage in stages:
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
        # One chunk per rank (vpp=1): hand the optimizer the stage's GPT itself, as the trainer does.
        opt = build_distributed_optimizer(engine.chunks[0], st, stage, dtype=torch.float32, optimizer=ADAMW)
        losses = [train_step(step_context(engine, st, torch.float32, tcfg, "1f1b"), opt,
                             micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO), i).loss
                  for i, d in enumerate(data)]
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5, f"zero={stage} pp=2 step {i}: loss {a} != reference {b}"
        for name, value in opt.full_parameters().items():  # tp=1: no TP gather needed
            expect = ref_params[name].detach()
            if name.endswith("attn.qkv.bias"):
                h = cfg.hidden_size
                value, expect = torch.cat([value[:h], value[-h:]]), torch.cat([expect[:h], expect[-h:]])
            # 1e-4: the pipeline tolerance of tests/test_pipeline.py (per-stage norm sums, then all-reduced).
            assert (value - expect).abs().max().item() <= 1e-4, f"zero={stage} pp=2: {name}"


@pytest.mark.parametrize("stages,arch", [([0, 1, 2], "gpt2"), ([3], "llama")])
def test_zero_with_pipeline(dist_world, stages: list[int], arch: str) -> None:
    """Stage 3 with pp > 1 needs untied embeddings (llama): see the ConfigError for tied ones. Stages 0-2
    share one run (and its reference)."""
    dist_world(4).run(_check_pipeline, stages, arch)
