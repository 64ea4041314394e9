"""The estimator's predictions equal what a run measures: comm bytes per group (the counter) and
model-state bytes per rank (the optimizer's tensors, what `metrics.jsonl` logs as `mem_bytes`),
exactly, for small layouts on gloo, in fp32 and in bf16 with megalite's memory layout (bf16 params,
fp32 main grads, fp32 master, Adam: 18 bytes/param before sharding; `Precision.megalite`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.perfmodel.estimate import Layout, ModelDims, Precision, estimate, stage_params, zero_memory
from megalite.optim import build_distributed_optimizer
from megalite.pipeline import build_pipeline
from megalite.training.step import train_step
from tests.parallel_utils import ADAMW, layout, step_context, tiny_model_cfg, tiny_train_cfg

MICRO, M = 2, 4  # micro-batch size, micro-batches per step and dp rank


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _measure(rank: int, tp: int, pp: int, sp: bool, zero: int, dtype_name: str = "fp32",
             recompute: str = "none") -> dict:
    dtype = DTYPES[dtype_name]
    st = layout(tp, pp, sp=sp)
    cfg = tiny_model_cfg("llama", num_layers=4, recompute=recompute)
    engine = build_pipeline(cfg, st, seed=1, micro_batch_size=MICRO, dtype=dtype)
    model = engine.chunks[0] if len(engine.chunks) == 1 else nn.ModuleList(engine.chunks)
    opt = build_distributed_optimizer(model, st, zero, dtype, optimizer=ADAMW)
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, cfg.vocab_size, (MICRO * M, cfg.seq_len + 1), generator=gen)
    batches = [(data[i:i + MICRO, :-1], data[i:i + MICRO, 1:]) for i in range(0, MICRO * M, MICRO)]
    st.counter.reset()
    train_step(step_context(engine, st, dtype, tiny_train_cfg(2), "1f1b"), opt, batches, 0)
    return {"comm": st.counter.bytes(), "mem": opt.memory_bytes(), "pp_rank": st.pp_rank}


@pytest.mark.parametrize("tp,pp,sp,zero,dtype,recompute", [
    (2, 1, False, 0, "fp32", "none"), (2, 1, True, 1, "fp32", "none"), (1, 2, False, 2, "fp32", "none"),
    (2, 2, True, 0, "fp32", "none"), (2, 1, True, 1, "bf16", "none"), (1, 2, False, 2, "bf16", "none"),
    (1, 1, False, 3, "bf16", "none"),
    # full recompute re-runs each block's forward collectives but the last (torch's checkpoint stops early)
    (2, 1, False, 0, "fp32", "full"), (2, 2, True, 0, "fp32", "full"), (2, 1, True, 0, "fp32", "selective"),
])
def test_predicted_equals_measured(dist_world, tp: int, pp: int, sp: bool, zero: int, dtype: str,
                                   recompute: str) -> None:
    out = dist_world(4).run(_measure, tp, pp, sp, zero, dtype, recompute)
    cfg = tiny_model_cfg("llama", num_layers=4)
    dims = ModelDims(num_layers=4, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, vocab_size=cfg.vocab_size,
                     seq_len=cfg.seq_len, arch="llama", num_kv_heads=cfg.num_kv_heads,
                     ffn_hidden_size=cfg.ffn_hidden_size, tie_embeddings=False,
                     make_vocab_divisible_by=cfg.make_vocab_divisible_by)
    dp = 4 // (tp * pp)
    lay = Layout(tp=tp, pp=pp, dp=dp, zero=zero, sp=sp, micro_batch_size=MICRO, global_batch_size=MICRO * M * dp,
                 recompute=recompute)
    prec = Precision.megalite(dtype)  # fp32: the same bytes as Precision.for_dtype("fp32")
    est = estimate(dims, lay, prec)
    for group in ("tp", "pp", "dp"):
        measured = max(r["comm"].get(group, 0.0) for r in out)  # the estimator reports the busiest rank
        assert measured == pytest.approx(est.comm_bytes.get(group, 0.0), rel=1e-12), group
    for r in out:  # model-state bytes of each rank's own stage
        predicted = zero_memory(stage_params(dims, tp, pp, r["pp_rank"]).total, dp, zero, prec)
        for kind in ("params", "grads", "master", "optimizer"):
            assert r["mem"][kind] == pytest.approx(getattr(predicted, kind), rel=1e-12), kind


@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_estimate_of_a_runs_config_equals_its_logged_mem_bytes(dtype: str, demo_cache_dir: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`tools/estimate.py --config <run>/config.toml` predicts the model-state bytes the run logged as
    `mem_bytes`, exactly: megalite's layout (fp32 main grads) and dtype auto resolved as pretrain.py does."""
    from megalite.training.trainer import main as pretrain_main
    from tests.conftest import SMALL_RUN
    from tools.estimate import main as estimate_main

    run = tmp_path / "run"
    assert pretrain_main(["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(run),
                          "--train.steps", "2", "--train.dtype", dtype]) == 0
    measured = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["mem_bytes"]
    capsys.readouterr()
    assert estimate_main(["--config", str(run / "config.toml"), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["memory"]
    for kind in ("params", "grads", "master", "optimizer"):
        assert predicted[kind] == measured[kind], kind  # integers of bytes: exact
    if dtype == "bf16":
        assert predicted["grads"] == 2 * predicted["params"]  # fp32 main grads of bf16 params
