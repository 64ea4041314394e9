"""A transformers-built Mixtral / Qwen3-MoE imported with tools/import_hf.py trains at ep 2 (2 gloo ranks, dp 2)
with the losses transformers computes, its auxiliary load-balancing loss included; and model.qk_norm (Qwen3's
per-head q/k RMSNorm) at tp 2 + SP equals one process. One task per world: the ranks start once.

transformers' side: the same micro-batches, loss = cross-entropy + router_aux_loss_coef x aux per micro-batch,
averaged, then torch AdamW as megalite's (weight decay on matrices only, global-norm clipping at 1.0). Its aux
is load_balancing_loss_func: with one MoE layer (the Qwen3-MoE, decoder_sparse_step 2) it is transformers' own
reported `aux_loss`; with two (the Mixtral) transformers pools both layers' counts before the product, and
megalite's (Megatron's) is the mean over layers of that function applied to each layer (megalite/checkpoint/
hf_moe.py's doc), which is what the reference uses there.

Tolerances: fp32, the same math summed in another order (the experts' gradients over the all-to-all and dp),
so losses agree to 1e-5 and the aux losses to 1e-6 (round-off of O(1) values); step 1's loss is after an AdamW
step from these gradients, so a missing aux-loss gradient or a wrong scaling shows there too. qk_norm: as
tests/test_tensor_parallel.py (1e-5 on losses, 1e-4 on parameters after 3 steps at lr 1e-2: Adam turns
round-off of near-zero gradients into ~1e-5); without the TP sum of the q/k norm gradients they are off by O(lr).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint.sharded import load_sharded, read_index
from megalite.inference.load import model_config_from_info
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.adamw import LossScaler
from megalite.parallel.sharding import full_state_dict
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import HYPER, micro_batches, random_steps, reference_optimizer, tiny_train_cfg, train_steps
from tests.test_hf_moe import VOCAB, hf_model, saved
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

STEPS, MICRO, M, DP, COEF = 2, 2, 2, 2, 0.1
LOSS_ATOL, AUX_ATOL, PARAM_ATOL = 1e-5, 1e-6, 1e-4


def _rank_batches(d: torch.Tensor, dp: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    per_rank = d.shape[0] // dp
    return micro_batches(d[rank * per_rank:(rank + 1) * per_rank], MICRO)


def _megalite_ep2(rank: int, ckpt: str, data: list[torch.Tensor]) -> list[tuple[float, float, dict[str, float]]]:
    """Load the imported checkpoint at ep 2 (each rank half the experts) and train; (loss, norm, aux) per step."""
    st = moe_layout(ep=2)
    cfg = model_config_from_info(read_index(Path(ckpt))["model"])
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
    load_sharded(ckpt, engine.chunks, None, st)
    opt = build_distributed_optimizer(engine.chunks[0], st, 0, dtype=torch.float32, **HYPER)
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


def _transformers_reference(model: Any, data: list[torch.Tensor], one_layer: bool) -> list[tuple[float, dict]]:
    """transformers' losses on the same micro-batches and AdamW steps: (cross-entropy, aux per MoE layer)."""
    model.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], foreach=False)
    e, k = model.config.num_local_experts, model.config.num_experts_per_tok
    out = []
    for d in data:
        batches = [mb for r in range(DP) for mb in _rank_batches(d, DP, r)]
        ces, auxes = [], []
        for ids, tgt in batches:
            res = model(ids, output_router_logits=True)
            ce = F.cross_entropy(res.logits.reshape(-1, VOCAB), tgt.reshape(-1))
            per_layer = [load_balancing_loss_func((g,), e, k) for g in res.router_logits]
            if one_layer:  # transformers' own number is megalite's form exactly
                assert len(per_layer) == 1 and torch.allclose(res.aux_loss, per_layer[0], atol=0, rtol=1e-6)
                per_layer = [res.aux_loss]
            (ce + model.config.router_aux_loss_coef * torch.stack(per_layer).mean()).div(len(batches)).backward()
            ces.append(ce.item())
            auxes.append([a.item() for a in per_layer])
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        opt.step()
        opt.zero_grad()
        out.append((sum(ces) / len(ces), [sum(col) / len(col) for col in zip(*auxes)], norm))
    return out


def test_imported_moe_trains_at_ep2_like_transformers_and_qk_norm_at_tp2(dist_world, tmp_path: Path) -> None:
    torch.manual_seed(0)
    models = {kind: hf_model(kind, output_router_logits=True, router_aux_loss_coef=COEF)
              for kind in ("mixtral", "qwen3_moe")}
    ckpts = {}
    for kind, model in models.items():
        ckpts[kind] = str(tmp_path / f"ckpt_{kind}")
        assert import_main(["--input", str(saved(model, tmp_path / kind)), "--output", ckpts[kind], "--quiet"]) == 0
        assert read_index(Path(ckpts[kind]))["model"]["moe_aux_loss"] == COEF
    data = random_steps(model_config_from_info(read_index(Path(ckpts["mixtral"]))["model"]), STEPS, MICRO * M * DP)
    ranks = dist_world(2).run(_world2, ckpts, data)
    for kind, model in models.items():
        want = _transformers_reference(model, data, one_layer=kind == "qwen3_moe")
        for rank_result in ranks:
            for i, ((loss, norm, aux), (ce, hf_aux, hf_norm)) in enumerate(zip(rank_result[kind], want)):
                assert abs(loss - ce) <= LOSS_ATOL, f"{kind} step {i}: loss {loss} != transformers' {ce}"
                assert abs(norm - hf_norm) <= 1e-5 * hf_norm, f"{kind} step {i}: grad norm {norm} != {hf_norm}"
                assert len(aux) == len(hf_aux), (kind, aux)
                for (name, a), b in zip(sorted(aux.items()), hf_aux):
                    assert abs(a - b) <= AUX_ATOL, f"{kind} step {i} {name}: aux {a} != transformers' {b}"
