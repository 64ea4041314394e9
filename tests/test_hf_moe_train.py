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

from megalite.checkpoint.sharded import read_index
from megalite.inference.load import model_config_from_info
from tests.hf_moe_ranks import LOSS_ATOL, MICRO, STEPS, _rank_batches, _world2
from tests.parallel_utils import HYPER, random_steps
from tests.test_hf_moe import VOCAB, hf_model, saved
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

M, DP, COEF = 2, 2, 0.1  # STEPS and MICRO: tests/hf_moe_ranks.py's
AUX_ATOL = 1e-6


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
