"""DeepSeek-V3's MoE layer exactly (Liu et al. 2024, arXiv 2412.19437, section 2.1.2): megalite's layer against
transformers' `DeepseekV3MoE` with the same weights (sigmoid scores, the correction bias choosing but not
weighing, group-limited top-k that really filters, norm_topk_prob, routed_scaling_factor, a shared expert):
output, input gradient and every weight gradient; the sequence-wise balance loss against the paper's formula
written out; and the bias update as an explicit step after the optimizer (none on a skipped step).

Tolerances: fp32 in both; the two sum the same expert outputs in another order (per-expert loops vs grouped
GEMMs), so 1e-5 absolute on O(1) values; the routing itself (which experts) must be identical.
"""

from __future__ import annotations

import torch

from megalite.model.block import MLP
from megalite.model.gpt import GPT
from megalite.model.ops import TORCH_OPS
from megalite.moe.balance import update_router_biases
from megalite.moe.layer import MoELayer
from megalite.moe.losses import AuxScale
from megalite.moe.layer import MoEContext
from megalite.moe.settings import moe_settings
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.state import ParallelState
from megalite.training.step import train_step
from tests.moe_utils import tiny_moe_cfg
from tests.parallel_utils import HYPER, micro_batches, random_steps, step_context

TOL = 1e-5
H, E, K, F, GROUPS, TOPK_GROUPS, SCALE = 32, 8, 2, 16, 4, 2, 2.5


def _ours(**kw: object) -> MoELayer:
    cfg = tiny_moe_cfg(hidden_size=H, moe_experts=E, moe_top_k=K, moe_ffn_hidden_size=F, moe_shared_experts=1,
                       moe_router="deepseek", moe_groups=GROUPS, moe_group_top_k=TOPK_GROUPS,
                       moe_route_scale=SCALE, moe_renorm=True, moe_aux_loss=0.0, moe_z_loss=0.0, **kw)
    s = moe_settings(cfg)
    assert s is not None
    return MoELayer(cfg, MoEContext(s, AuxScale(), 1), ParallelState(), TORCH_OPS, "layers.0.mlp", 3, MLP)


def _theirs(ours: MoELayer):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
                           n_shared_experts=1, n_group=GROUPS, topk_group=TOPK_GROUPS, norm_topk_prob=True,
                           routed_scaling_factor=SCALE, hidden_act="silu")
    hf = DeepseekV3MoE(cfg).float()
    assert ours.shared is not None
    shared_up = ours.shared.up.weight
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.gate.e_score_correction_bias.copy_(ours.router.bias)
        hf.experts.gate_up_proj.copy_(ours.experts.up)     # [E, 2F, H]: gate rows first, as ours
        hf.experts.down_proj.copy_(ours.experts.down)
        hf.shared_experts.gate_proj.weight.copy_(shared_up[:F])
        hf.shared_experts.up_proj.weight.copy_(shared_up[F:])
        hf.shared_experts.down_proj.weight.copy_(ours.shared.down.weight)
    return hf


def test_deepseek_moe_equals_transformers_forward_and_backward() -> None:
    ours = _ours()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-zero correction bias, large enough to change choices, small enough to keep
        ours.router.bias.copy_(0.05 * torch.randn(E, generator=gen))  # every biased score > 0
        ours.router.weight.mul_(20)  # spread scores so that groups differ
    hf = _theirs(ours)
    x = torch.randn(2, 12, H, generator=gen)
    g = torch.randn(2, 12, H, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours.eval()  # no router losses: the output alone
    y = ours(xa)
    want = hf(xb)
    # The group limit filters: some token's top-k differs from an unlimited top-k of the biased scores.
    flat = x.reshape(-1, H)
    routing = ours.router(flat)
    choice = (flat @ ours.router.weight.t()).sigmoid() + ours.router.bias
    assert not torch.equal(routing.experts.sort(-1).values, choice.topk(K).indices.sort(-1).values)
    _, _, hf_idx = hf.gate(flat)
    assert torch.equal(routing.experts.sort(-1).values, hf_idx.sort(-1).values)
    torch.testing.assert_close(y, want, atol=TOL, rtol=0)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, atol=TOL, rtol=0)
    assert ours.shared is not None
    pairs = [(ours.router.weight.grad, hf.gate.weight.grad), (ours.experts.up.grad, hf.experts.gate_up_proj.grad),
             (ours.experts.down.grad, hf.experts.down_proj.grad),
             (ours.shared.up.weight.grad, torch.cat([hf.shared_experts.gate_proj.weight.grad,
                                                     hf.shared_experts.up_proj.weight.grad])),
             (ours.shared.down.weight.grad, hf.shared_experts.down_proj.weight.grad)]
    for got, exp in pairs:
        torch.testing.assert_close(got, exp, atol=TOL, rtol=0)


def test_sequence_wise_balance_loss_is_the_papers() -> None:
    """L_Bal = alpha sum_i f_i P_i per sequence (eq. 17-20), f_i = E/(K T) count_i, P_i = mean of the
    normalised scores s'_i: its value in the metrics and its gradient on the router equal the formula's."""
    alpha = 0.1
    layer = _ours(moe_seq_aux_loss=alpha)
    layer.train()
    x = torch.randn(3, 6, H, generator=torch.Generator().manual_seed(1))
    layer(x).sum().backward()
    got_grad = layer.router.weight.grad.clone()
    got_value = layer.stats.seq_aux
    layer.zero_grad()
    layer.eval()
    out = layer(x)
    losses = []
    for seq in x:
        route = layer.router(seq)
        scores = (seq @ layer.router.weight.t()).sigmoid()
        s_norm = scores / scores.sum(-1, keepdim=True)
        f = E / (K * seq.shape[0]) * torch.bincount(route.experts.flatten(), minlength=E).float()
        losses.append((f * s_norm.mean(0)).sum())
    want = torch.stack(losses).mean()
    assert abs(got_value - float(want.detach())) <= 1e-6
    (out.sum() + alpha * want).backward()
    torch.testing.assert_close(got_grad, layer.router.weight.grad, atol=1e-6, rtol=0)


def test_bias_moves_after_the_optimizer_step_and_not_on_a_skipped_one() -> None:
    cfg = tiny_moe_cfg(moe_router="deepseek", moe_bias_rate=0.01, seq_len=8)
    st = ParallelState()
    model = GPT(cfg, st, seed=2)
    opt = ReferenceOptimizer(model, st, **HYPER)
    ctx = step_context(model, st)
    data = random_steps(cfg, 2, 4)
    biases = lambda: [b.clone() for n, b in model.named_buffers() if n.endswith("router.bias")]  # noqa: E731
    before = biases()
    result = train_step(ctx, opt, micro_batches(data[0], 2), 0, poison_grads=True)
    assert result.skipped and all(torch.equal(a, b) for a, b in zip(before, biases()))
    assert result.moe is not None and set(result.moe["seq_aux_loss"]) == {"layers.0", "layers.1"}
    train_step(ctx, opt, micro_batches(data[1], 2), 1)
    after = biases()
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    # Calling the update by name is the only way the bias moves: the metrics only read.
    from megalite.moe.step_metrics import moe_step_metrics
    moe_step_metrics([model], st)
    assert all(torch.equal(a, b) for a, b in zip(after, biases()))
    update_router_biases([model], st)  # nothing recorded since the metrics reset the records: sign(0) = 0
    assert all(torch.equal(a, b) for a, b in zip(after, biases()))
