"""The estimator's predictions equal what a run measures: comm bytes per group (the counter) and
model-state bytes per rank (the optimizer's tensors), exactly, for small layouts on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megalite.perfmodel.estimate import Layout, ModelDims, Precision, estimate, stage_params, zero_memory
from megalite.optim import build_distributed_optimizer
from megalite.optim.adamw import LossScaler
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.parallel_utils import layout, tiny_model_cfg, tiny_train_cfg

MICRO, M = 2, 4  # micro-batch size, micro-batches per step and dp rank


def _measure(rank: int, tp: int, pp: int, sp: bool, zero: int) -> dict:
    st = layout(tp, pp, sp=sp)
    cfg = tiny_model_cfg("llama", num_layers=4)
    engine = build_pipeline(cfg, st, seed=1, micro_batch_size=MICRO, dtype=torch.float32)
    model = engine.chunks[0] if len(engine.chunks) == 1 else nn.ModuleList(engine.chunks)
    opt = build_distributed_optimizer(model, st, zero, 1e-2, 0.1, (0.9, 0.95), 1e-8, torch.float32)
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, cfg.vocab_size, (MICRO * M, cfg.seq_len + 1), generator=gen)
    batches = [(data[i:i + MICRO, :-1], data[i:i + MICRO, 1:]) for i in range(0, MICRO * M, MICRO)]
    st.counter.reset()
    train_step(StepContext.build(engine, st, torch.float32, tiny_train_cfg(2), LossScaler(False), "1f1b"),
               opt, batches, 0)
    return {"comm": st.counter.bytes(), "mem": opt.memory_bytes(), "pp_rank": st.pp_rank}


@pytest.mark.parametrize("tp,pp,sp,zero", [(2, 1, False, 0), (2, 1, True, 1), (1, 2, False, 2), (2, 2, True, 0)])
def test_predicted_equals_measured(dist_world, tp: int, pp: int, sp: bool, zero: int) -> None:
    out = dist_world(4).run(_measure, tp, pp, sp, zero)
    cfg = tiny_model_cfg("llama", num_layers=4)
    dims = ModelDims(num_layers=4, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, vocab_size=cfg.vocab_size,
                     seq_len=cfg.seq_len, arch="llama", num_kv_heads=cfg.num_kv_heads,
                     ffn_hidden_size=cfg.ffn_hidden_size, tie_embeddings=False,
                     make_vocab_divisible_by=cfg.make_vocab_divisible_by)
    dp = 4 // (tp * pp)
    lay = Layout(tp=tp, pp=pp, dp=dp, zero=zero, sp=sp, micro_batch_size=MICRO, global_batch_size=MICRO * M * dp)
    est = estimate(dims, lay, Precision.for_dtype("fp32"))
    for group in ("tp", "pp", "dp"):
        measured = max(r["comm"].get(group, 0.0) for r in out)  # the estimator reports the busiest rank
        assert measured == pytest.approx(est.comm_bytes.get(group, 0.0), rel=1e-12), group
    for r in out:  # model-state bytes of each rank's own stage
        predicted = zero_memory(stage_params(dims, tp, pp, r["pp_rank"]).total, dp, zero, Precision.for_dtype("fp32"))
        for kind in ("params", "grads", "master", "optimizer"):
            assert r["mem"][kind] == pytest.approx(getattr(predicted, kind), rel=1e-12), kind
