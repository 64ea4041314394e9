"""What tests/test_hf_moe_train.py runs in its 2 gloo ranks, in a module of its own: the ranks unpickle these
functions by importing their module, and the test module imports transformers (~5 CPU-s per process), which
the ranks never use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megalite.checkpoint.sharded import load_sharded, read_index
from megalite.inference.load import model_config_from_info
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.parallel.sharding import full_state_dict
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import (ADAMW, micro_batches, random_steps, reference_optimizer, tiny_train_cfg,
                                  train_steps)

STEPS, MICRO = 2, 2
LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-4  # explained in tests/test_hf_moe_train.py's doc


def _rank_batches(d: torch.Tensor, dp: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    per_rank = d.shape[0] // dp
    return micro_batches(d[rank * per_rank:(rank + 1) * per_rank], MICRO)


def _megalite_ep2(rank: int, ckpt: str, data: list[torch.Tensor]) -> list[tuple[float, float, dict[str, float]]]:
    """Load the imported checkpoint at ep 2 (each rank half the experts) and train; (loss, norm, aux) per step."""
    st = moe_layout(ep=2)
    cfg = model_config_from_info(read_index(Path(ckpt))["model"])
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
    load_sharded(ckpt, engine.chunks, None, st)
    opt = build_distributed_optimizer(engine.chunks[0], st, 0, dtype=torch.float32, optimizer=ADAMW)
    ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False), "1f1b")
    out = []
    for i, d in enumerate(data):
        r = train_step(ctx, opt, _rank_batches(d, st.dp, st.dp_rank), i)
        assert r.moe is not None
        out.append((r.loss, r.grad_norm, r.moe["aux_loss"]))
    return out


def _qk_norm_tp2_sp(rank: int) -> None:
    """model.qk_norm and model.head_dim at tp 2 + SP (a dense layer, then a MoE one) vs one process: losses and
    every parameter."""
    cfg = tiny_moe_cfg(seq_len=16, qk_norm=True, head_dim=8, moe_first_dense=1, moe_every=2)  # heads 8 wide, not 4
    data = random_steps(cfg, 3, 2 * MICRO)
    steps = [micro_batches(d, MICRO) for d in data]
    ref_state = ParallelState()
    ref = GPT(cfg, ref_state, seed=5)
    want = [r.loss for r in train_steps(ref, ref_state, reference_optimizer(ref, ref_state), steps)]
    st = moe_layout(tp=2, sp=True)
    model = GPT(cfg, st, seed=5)
    got = [r.loss for r in train_steps(model, st, reference_optimizer(model, st), steps)]
    assert all(abs(a - b) <= LOSS_ATOL for a, b in zip(got, want)), (got, want)
    ref_params = dict(ref.named_parameters())
    full = full_state_dict(model, st)
    assert any(n.endswith("attn.q_norm.weight") for n in full)
    for name, value in full.items():
        err = (value - ref_params[name].detach()).abs().max().item()
        assert err <= PARAM_ATOL, f"{name} off by {err:.2e} after 3 steps at tp2 + sp"


def _world2(rank: int, ckpts: dict[str, str], data: list[torch.Tensor]) -> dict[str, Any]:
    _qk_norm_tp2_sp(rank)
    return {kind: _megalite_ep2(rank, path, data) for kind, path in ckpts.items()}
