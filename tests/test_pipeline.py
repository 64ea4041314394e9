"""Pipeline parallelism against the single-process run, on gloo ranks.

Tolerance: a pipeline stage runs exactly the same ops as the reference (no sum is split across ranks
when tp=1), so pp-only losses agree to ~1e-7; with tp the TP tolerance argument of
tests/test_tensor_parallel.py applies (1e-5 on O(1) values, 1e-4 on parameters after 3 Adam steps).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from megalite.model.gpt import GPT
from megalite.parallel.sharding import full_state_dict
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline, build_schedule, max_in_flight
from megalite.pipeline.partition import virtual_stage_layers
from megalite.training.step import evaluate, train_step
from tests.parallel_utils import layout, reference_optimizer, step_context, tiny_model_cfg, tiny_train_cfg

STEPS, MICRO = 3, 2
# Parameters after 3 AdamW steps at lr 1e-2: Adam's first steps are ~lr * g/|g|, so a parameter with a
# near-zero gradient turns the ~1e-7 relative round-off of a differently ordered gradient-norm sum
# (per stage, then all-reduced) into up to ~1e-4 absolute. A wrong stage wiring or a missing gradient
# moves parameters by O(lr) = 1e-2, two orders above this.
PARAM_ATOL = 1e-4


def _batches(data: list[torch.Tensor], lo: int, hi: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(d[i:i + MICRO, :-1], d[i:i + MICRO, 1:]) for i in range(lo, hi, MICRO)] for d in data]


@dataclass(frozen=True)
class Reference:
    """The single-process run every rank compares against: per-step losses, parameters after them, and the
    validation loss of the first step's batch."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    valid: float


def _model_cfg(arch: str, untied: bool, pp: int):
    """2 layers per pipeline rank: 2 per stage with one stage per rank, 1 per virtual stage at vpp=2."""
    return tiny_model_cfg(arch, num_layers=2 * pp, **({"tie_embeddings": False} if untied else {}))


def _data(arch: str, global_batch: int) -> list[torch.Tensor]:
    cfg, gen = tiny_model_cfg(arch), torch.Generator().manual_seed(11)  # vocabulary and sequence only
    return [torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len + 1), generator=gen) for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def _reference(arch: str, untied: bool, pp: int, global_batch: int) -> Reference:
    """Computed once per (model, batch) in the pytest process and shipped to the ranks: every rank would
    otherwise rerun the same deterministic single-process training (most of the work at 4 and 8 ranks)."""
    cfg, data, state = _model_cfg(arch, untied, pp), _data(arch, global_batch), ParallelState()
    ref = GPT(cfg, state, seed=5)
    opt = reference_optimizer(ref, state)
    losses = [train_step(step_context(ref, state, torch.float32, tiny_train_cfg(STEPS)), opt, b, i).loss
              for i, b in enumerate(_batches(data, 0, global_batch))]
    params = {k: v.detach().clone() for k, v in ref.named_parameters(remove_duplicate=False)}
    valid = evaluate(ref, _batches(data, 0, global_batch)[0], state, torch.float32)
    return Reference(losses, params, valid)


def run_pipeline_check(dist_world, world: int, tp: int, pp: int, sp: bool, arch: str, schedule: str, vpp: int,
                       micro_batches: int, p2p_depth: int = 1) -> list[dict[str, float]]:
    """`_check_pipeline` on `world` ranks against the (cached) single-process reference of its global batch."""
    global_batch = MICRO * micro_batches * (world // (tp * pp))
    return dist_world(world).run(_check_pipeline, tp, pp, sp, arch, schedule, vpp, micro_batches, p2p_depth,
                                 _reference(arch, schedule == "zbv", pp, global_batch))  # zbv: gpt2 untied


def _check_pipeline(rank: int, tp: int, pp: int, sp: bool, arch: str, schedule: str, vpp: int,
                    micro_batches: int, p2p_depth: int, ref: Reference) -> dict[str, float]:
    st = layout(tp, pp, sp=sp)
    cfg = _model_cfg(arch, schedule == "zbv", pp)
    per_rank = MICRO * micro_batches
    data = _data(arch, per_rank * st.dp)
    tcfg = tiny_train_cfg(STEPS)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            stages=StagePlan(vpp=vpp, schedule=schedule))
    engine.p2p_depth = p2p_depth  # receives posted ahead (tests/test_pipeline_p2p.py varies it)
    opt = reference_optimizer(nn.ModuleList(engine.chunks), st)
    mine = _batches(data, st.dp_rank * per_rank, (st.dp_rank + 1) * per_rank)
    st.counter.reset()
    losses = [train_step(step_context(engine, st, torch.float32, tcfg, schedule),
                         opt, b, i).loss
              for i, b in enumerate(mine)]
    counted = st.counter.bytes()
    pp_bytes = st.counter.exact_bytes("pp")
    for i, (a, b) in enumerate(zip(losses, ref.losses)):
        assert abs(a - b) <= 1e-5, f"step {i}: loss {a} != reference {b}"
    for chunk in engine.chunks:
        for name, value in full_state_dict(chunk, st).items():
            expected = ref.params[name]
            if name.endswith("attn.qkv.bias"):  # see tests/test_tensor_parallel.py: the key bias has no gradient
                h = cfg.hidden_size
                value, expected = torch.cat([value[:h], value[-h:]]), torch.cat([expected[:h], expected[-h:]])
            err = (value - expected).abs().max().item()
            assert err <= PARAM_ATOL, f"{name}: max abs error {err:.2e} after {STEPS} steps"
    act = MICRO * (cfg.seq_len // tp if sp else cfg.seq_len) * cfg.hidden_size * 4
    remote = [(vs, vs + 1) for vs in range(engine.num_stages - 1) if engine._pp_rank(vs) != engine._pp_rank(vs + 1)]
    sends = sum((vs, vs + 1) in remote for vs in engine.chunk_stages) + sum((vs - 1, vs) in remote
                                                                           for vs in engine.chunk_stages)
    assert pp_bytes == STEPS * micro_batches * act * sends, f"pp bytes {pp_bytes} != formula"
    valid = evaluate(engine, mine[0], st, torch.float32)
    assert valid == pytest.approx(ref.valid, abs=1e-5)
    return {"peak_in_flight": engine.peak_in_flight, **counted}


CASES = [  # (world, tp, pp, sp, schedule, vpp, micro_batches per dp rank)
    (2, 1, 2, False, "gpipe", 1, 4), (2, 1, 2, False, "1f1b", 1, 4), (2, 1, 2, False, "interleaved", 2, 4),
    (4, 1, 4, False, "gpipe", 1, 4), (4, 1, 4, False, "1f1b", 1, 8), (4, 1, 4, False, "interleaved", 2, 4),
    (2, 1, 2, False, "zb-h1", 1, 4), (2, 1, 2, False, "zbv", 2, 4),
    (4, 1, 4, False, "zb-h1", 1, 8), (4, 1, 4, False, "zbv", 2, 8),
]


# gpt2 (tied embedding and head, synced between the first and the last stage; zbv runs it untied): llama at every
# schedule on the same 2- and 4-rank layouts is tests/test_pipeline_p2p.py's prefetch-depth parity (depths 0 and 3
# there, the default 1 here; the messages' shapes do not depend on the architecture).
@pytest.mark.parametrize("world,tp,pp,sp,schedule,vpp,m", CASES)
def test_pipeline_matches_single_process(dist_world, world, tp, pp, sp, schedule, vpp, m) -> None:
    out = run_pipeline_check(dist_world, world, tp, pp, sp, "gpt2", schedule, vpp, m)
    first_stage = out[0]
    if schedule == "gpipe":
        assert first_stage["peak_in_flight"] == m  # GPipe holds all M micro-batches
    elif schedule == "1f1b":
        assert first_stage["peak_in_flight"] == min(pp, m)  # 1F1B caps it at P
    elif schedule == "zb-h1":  # F until W: 1F1B's first-stage peak P, on every rank
        assert [r["peak_in_flight"] for r in out] == [min(pp, m)] * pp
    elif schedule == "zbv":
        assert max(r["peak_in_flight"] for r in out) <= 2 * pp  # 2P half-stage chunks: 1F1B's bytes


# M = pp = 2 micro-batches per dp rank: each schedule's shape at M >= P is test_pipeline_matches_single_process's;
# here M = 2 still accumulates gradients over micro-batches before the DP/embedding syncs. tp=2 x pp=2 x dp=2
# (8 ranks) runs zb-h1 and zbv only: 1F1B sends the same messages between the same ranks as zb-h1 (one stage per
# rank, tied embedding synced) and is at tp=2 and at dp=2 on 4 ranks.
@pytest.mark.parametrize("world,tp,pp,sp,schedule,vpp", [
    (4, 2, 2, True, "1f1b", 1),        # tp=2 x pp=2 with SP
    (4, 1, 2, False, "1f1b", 1),       # dp=2 x pp=2
    (4, 2, 2, True, "interleaved", 2),
    (4, 2, 2, True, "zb-h1", 1), (4, 1, 2, False, "zb-h1", 1),
    (8, 2, 2, True, "zb-h1", 1),       # tp=2 x pp=2 x dp=2 with SP
    (4, 2, 2, True, "zbv", 2), (4, 1, 2, False, "zbv", 2), (8, 2, 2, True, "zbv", 2),
])
def test_pipeline_composes_with_tp_sp_dp(dist_world, world, tp, pp, sp, schedule, vpp) -> None:
    out = run_pipeline_check(dist_world, world, tp, pp, sp, "gpt2", schedule, vpp, 2)
    if world // (tp * pp) > 1:
        assert out[0]["dp"] > 0
    if schedule != "zbv":  # zbv runs gpt2 untied
        assert out[0]["embedding"] > 0  # tied gpt2 embedding synced between first and last stage


def test_schedule_shapes_and_memory() -> None:
    for p in (2, 4, 8):
        for m in (p, 2 * p, 3 * p):
            for r in range(p):
                for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
                    acts = build_schedule(name, m, p, r, v)
                    assert sorted(a for a in acts if a[0] == "F") == sorted(("F", i, c) for i in range(m) for c in range(v))
                    assert len(acts) == 2 * m * v
            assert max_in_flight(build_schedule("1f1b", m, p, 0)) == p
            assert max_in_flight(build_schedule("gpipe", m, p, 0)) == m
            assert max_in_flight(build_schedule("1f1b", m, p, p - 1)) == 1


def test_partition() -> None:
    assert virtual_stage_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert virtual_stage_layers(5, 2, 1, [2, 3]) == [range(0, 2), range(2, 5)]
    with pytest.raises(Exception, match="not divisible"):
        virtual_stage_layers(6, 4, 1)
