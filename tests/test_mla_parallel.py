"""A tiny MLA model (2 layers per stage, hidden 64, 4 heads, kv_lora_rank 16, qk_rope 8, qk_nope 16, v_head 12, with
and without the low-rank query, YaRN on) trained at tp 2 (+ sp, under ZeRO-3), cp 2 in every mode with document
masking, cp 4 hybrid, tp 2 + sp x cp 2 a2a and pp 2 (zb-h1), against the single-process run: each step's loss and gradient
norm, and every parameter after the steps.

One rank function runs every layout in turn in one warm pool of 4 gloo ranks (the reference is recomputed per
layout: each rank's own copy, cheap at this size). Tolerances as tests/test_cp_training.py: the layouts sum the
same terms in another order (tp's partial sums of the replicated q_a / kv_a gradients, the ring's log-sum-exp
merges, dp x cp's gradient average): O(1) losses agree to 1e-5, the norms to 1e-5 relative, parameters after
AdamW steps at lr 1e-2 to 1e-4 (a wrong split or a missing TP reduction of a replicated gradient moves them O(lr)).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.checkpoint.sharded import save_sharded
from megalite.context.options import ContextOptions
from megalite.mla.config import MLAConfig
from megalite.mla.costs import MLADims
from megalite.perfmodel.estimate import Layout, ModelDims, Precision, tp_comm_bytes
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import train_step
from tests.parallel_utils import ADAMW, HYPER, with_sections, layout, micro_batches, random_steps, reference_optimizer, step_context
from tests.parallel_utils import tiny_model_cfg, tiny_train_cfg
from tests.test_cp_training import PARAM_ATOL, assert_params_match, local_batches

STEPS, MICRO, SEQ, EOD = 2, 2, 16, 3
# YaRN on (its tables are indexed at each rank's zigzag and per-document positions; its scale folded into q).
YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_positions=4, rope_mscale=1.0,
            rope_mscale_all_dim=1.0)
LOSS_ATOL = 1e-5


def _mla(q_lora: int) -> MLAConfig:
    return MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def _check(tp: int, cp: int, pp: int, sp: bool, mode: str, eod: int | None, q_lora: int, recompute: str,
           a2a: int = 1, zero: int = 0, save: str = "", schedule: str = "1f1b") -> dict[str, torch.Tensor]:
    """Train at the layout and compare (module doc); with `save`, write a checkpoint there. Returns the reference's
    parameters after the steps."""
    st = layout(tp, pp, sp=sp, cp=cp)
    what = f"MLA q_lora={q_lora} tp={tp} sp={sp} cp={cp} {mode} docs={eod is not None} pp={pp} {recompute} zero={zero}"
    cfg = tiny_model_cfg(seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4, num_layers=2 * pp,
                         recompute=recompute, **YARN)
    mla = _mla(q_lora)
    data = random_steps(cfg, STEPS, MICRO * 2 * st.dp)  # 2 micro-batches per rank and step
    if eod is not None:  # documents of random lengths: about one token in five ends one
        data = [torch.where(d % 5 == 0, eod, d) for d in data]
    context = ContextOptions.of(mode, eod, a2a)
    ref_state = ParallelState()
    ref = GPT(with_sections(cfg, mla=mla), ref_state, seed=5, context=context)
    ref_opt = reference_optimizer(ref, ref_state)
    want = [train_step(step_context(ref, ref_state, torch.float32, tiny_train_cfg(STEPS)), ref_opt,
                       micro_batches(d, MICRO), i) for i, d in enumerate(data)]
    engine = build_pipeline(with_sections(cfg, mla=mla), st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            context=context, stages=StagePlan(schedule=schedule))
    model: nn.Module = engine.chunks[0]
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(STEPS), schedule)
    st.counter.reset()
    got = [train_step(ctx, opt, local_batches(d, st), i) for i, d in enumerate(data)]
    if tp > 1 and cp == pp == 1 and zero == 0:  # the estimator's tp bytes, MLA's partial-gradient all-reduce included
        dims = ModelDims(cfg.num_layers, 64, 4, cfg.vocab_size, SEQ, num_kv_heads=4, ffn_hidden_size=cfg.ffn_hidden_size,
                         mla=MLADims.of(mla))
        lay = Layout(tp=tp, dp=st.dp, sp=sp, micro_batch_size=MICRO, global_batch_size=MICRO * 2 * st.dp,
                     recompute=recompute)
        tp_bytes = STEPS * tp_comm_bytes(dims, lay, Precision.megalite("fp32"), 0, 2)
        assert st.counter.exact_bytes("tp") == tp_bytes, f"{what}: tp bytes {st.counter.exact_bytes('tp')} != {tp_bytes}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g.loss - w.loss) <= LOSS_ATOL, f"{what}: step {i} loss {g.loss} != single-process {w.loss}"
        assert abs(g.grad_norm - w.grad_norm) <= 1e-5 * w.grad_norm, f"{what}: step {i} grad norm"
    assert_params_match(opt, st, engine.chunks, ref, what)
    if save:
        save_sharded(save, STEPS, engine.chunks, opt, {}, st, keep=0)
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _rank_fn(rank: int, ckpt: str) -> dict[str, torch.Tensor]:
    saved = _check(2, 1, 1, True, "ring", None, 32, "selective", zero=3, save=ckpt)  # tp + sp (x dp 2, ZeRO-3)
    _check(2, 1, 1, False, "ring", None, 0, "full")         # tp, the plain q projection, full recompute
    for mode in ("ring", "allgather", "a2a"):                # cp 2 (x dp 2), each mode under document masking
        _check(1, 2, 1, False, mode, EOD, 32, "none")
    _check(1, 4, 1, False, "hybrid", EOD, 0, "none", a2a=2)  # cp 4 = a2a 2 x ring 2
    _check(2, 2, 1, True, "a2a", EOD, 0, "none")             # tp 2 + sp x cp 2: one head per rank in the a2a
    _check(1, 1, 2, False, "ring", None, 32, "none", schedule="zb-h1")  # pp 2 (x dp 2), zero-bubble: W deferred
    return saved


def test_mla_trains_as_one_process(dist_world, tmp_path) -> None:
    """And the tp 2 + sp + ZeRO-3 run's checkpoint loads in one process (`load_model`: resharded to tp 1, its
    `[mla]` widths from the index) with the single-process run's parameters."""
    from megalite.inference.load import load_model

    ref = dist_world(4).run(_rank_fn, str(tmp_path))[0]
    model, _ = load_model(tmp_path)
    for name, p in model.state_dict().items():
        rows = model.cfg.vocab_size if name in ("embedding.weight", "head.weight") else None  # padding rows: not saved
        assert (p[:rows] - ref[name][:rows]).abs().max().item() <= PARAM_ATOL, name
