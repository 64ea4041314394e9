"""The MoE layer in one process: grouped GEMMs against the loop, the three routers against their formulas
(and transformers' Qwen3-MoE router), the layer against a token-by-token reference, the router losses'
gradient through the attached backward, capacity dropping, parameter counts and the config's one-line
errors.

Tolerances: fp32 throughout; the grouped GEMM and the per-expert loop are the same products (1e-5 on O(1)
values: a different blocking of the same dot products); the layer against the token loop 1e-5 likewise.
"""

from __future__ import annotations

import pytest
import torch

from megalite.config import parse_args, resolve, validate
from megalite.errors import ConfigError
from megalite.model.gpt import GPT, count_parameters
from megalite.model.ops import TORCH_OPS
from megalite.moe.dispatch import capacity, dispatch
from megalite.moe.grouped import HAS_GROUPED_MM, can_group, grouped_mm, grouped_mm_loop
from megalite.moe.layer import MoEContext, MoELayer
from megalite.moe.losses import AuxScale
from megalite.moe.router import Router
from megalite.moe.config import MoEConfig
from megalite.moe.settings import moe_settings
from megalite.parallel.state import ParallelState
from megalite.perfmodel.moe import moe_param_counts
from tests.moe_utils import tiny_moe_cfg

TOL = 1e-5


def test_torch_has_grouped_mm() -> None:
    """megalite's grouped expert GEMM uses the private `torch._grouped_mm` (in one wrapper,
    megalite/moe/grouped.py); a torch without it falls back to the loop, and this test names it."""
    assert HAS_GROUPED_MM, f"torch {torch.__version__} lacks torch._grouped_mm: expert GEMMs run the per-expert loop"


@pytest.mark.parametrize("counts", [[3, 0, 7, 6], [0, 0, 16, 0], [0, 0, 0, 0]])
def test_grouped_mm_equals_loop_forward_and_backward(counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=gen)
    w = torch.randn(4, 8, 16, generator=gen)
    g = torch.randn(sum(counts), 8, generator=gen)
    outs = []
    for fn in (lambda a, b: grouped_mm(a, b, torch.tensor(counts)), lambda a, b: grouped_mm_loop(a, b, counts)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(g)
        outs.append((y.detach(), xa.grad, wa.grad))
    assert can_group(x, w)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    # an expert without rows gets a zero gradient (not None: the optimizer's hooks count on it)
    assert all(outs[1][2][e].abs().sum() == 0 for e, c in enumerate(counts) if c == 0)


def _settings(**kw) -> MoEConfig:
    cfg = tiny_moe_cfg(**kw)
    s = moe_settings(cfg)
    assert s is not None
    return s


def test_routers_follow_their_formulas() -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 32)
    for router in ("mixtral", "qwen3", "deepseek"):
        r = Router(32, _settings(moe_router=router), False, "r", 1, 0.5)
        out = r(x)
        logits = x @ r.weight.t()
        if router == "mixtral":
            top, idx = logits.topk(2)
            torch.testing.assert_close(out.weights, top.softmax(-1))
        elif router == "qwen3":
            top, idx = logits.softmax(-1).topk(2)
            torch.testing.assert_close(out.weights, top / top.sum(-1, keepdim=True))
        else:
            scores = logits.sigmoid()
            top, idx = scores.topk(2)
            torch.testing.assert_close(out.weights, top / top.sum(-1, keepdim=True))
        assert torch.equal(out.experts, idx)


def test_qwen3_router_equals_transformers() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True))
    r = Router(32, _settings(), False, "r", 1, 0.5)
    with torch.no_grad():
        hf.weight.copy_(r.weight)
    x = torch.randn(12, 32)
    _, weights, idx = hf(x)
    out = r(x)
    assert torch.equal(out.experts, idx)
    torch.testing.assert_close(out.weights, weights.float())


def test_deepseek_bias_and_group_limit_choose_but_do_not_weigh() -> None:
    s = _settings(moe_router="deepseek", moe_groups=2, moe_group_top_k=1)
    r = Router(32, s, False, "r", 1, 0.5)
    x = torch.randn(20, 32)
    r.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))  # group 1 (experts 2, 3) always wins
    out = r(x)
    assert set(out.experts.flatten().tolist()) == {2, 3}
    scores = (x @ r.weight.t()).sigmoid()
    chosen = scores.gather(1, out.experts)
    torch.testing.assert_close(out.weights, chosen / chosen.sum(-1, keepdim=True))  # the bias does not weigh


def _layer(**kw) -> MoELayer:
    cfg = tiny_moe_cfg(**kw)
    s = moe_settings(cfg)
    from megalite.model.block import MLP
    return MoELayer(cfg, MoEContext(s, AuxScale(), 1), ParallelState(), TORCH_OPS, "layers.0.mlp", 3, MLP)


def test_layer_equals_token_by_token_reference() -> None:
    layer = _layer(moe_shared_experts=1)
    x = torch.randn(2, 5, 32)
    y = layer(x)
    flat = x.reshape(-1, 32)
    route = layer.router(flat)
    want = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(32)
        for j in range(2):
            e = int(route.experts[t, j])
            gate, up = (layer.experts.up[e] @ flat[t]).chunk(2)
            acc += route.weights[t, j] * (layer.experts.down[e] @ (torch.nn.functional.silu(gate) * up))
        want.append(acc)
    want_t = torch.stack(want).view(2, 5, 32) + layer.shared(x)
    torch.testing.assert_close(y, want_t, atol=TOL, rtol=0)


def test_router_losses_reach_the_router_through_the_attached_backward() -> None:
    """The aux and z-losses attached to the output give the router the gradient of
    output.sum() + aux_coef * aux + z_coef * z written out explicitly."""
    layer = _layer(moe_aux_loss=0.1, moe_z_loss=0.01)
    layer.train()
    x = torch.randn(2, 6, 32)
    layer(x).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    with torch.no_grad():
        pass
    flat = x.reshape(-1, 32)
    route = layer.router(flat)
    from megalite.moe.dispatch import combine
    rows, plan = dispatch(flat, route.experts, 4, ParallelState(), None)
    out = combine(layer.experts(rows, plan.local_counts), plan, route.weights, flat.shape[0], ParallelState())
    t = flat.shape[0]
    f = torch.bincount(route.experts.flatten(), minlength=4).float() / t
    aux = 4 * (f * route.probs.mean(0)).sum()
    z = torch.logsumexp(route.logits, -1).pow(2).mean()
    (out.sum() + 0.1 * aux + 0.01 * z).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, atol=1e-6, rtol=0)


def test_capacity_drops_and_counts() -> None:
    experts = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 2)  # 8 tokens, 16 assignments: 6 to experts 0 and 1
    x = torch.randn(8, 4)
    cap = capacity(8, 2, 4, 1.0)  # 4 per expert
    rows, plan = dispatch(x, experts, 4, ParallelState(), 1.0)
    assert cap == 4 and plan.dropped == 4 and plan.local_counts == [4, 4, 2, 2]
    _, dropless = dispatch(x, experts, 4, ParallelState(), None)
    assert dropless.dropped == 0 and dropless.local_counts == [6, 6, 2, 2]


def test_parameter_counts_total_and_active() -> None:
    cfg = tiny_moe_cfg(vocab_size=64, moe_shared_experts=1, moe_first_dense=1, num_layers=3)
    model = GPT(cfg, ParallelState(), seed=1)
    counts = moe_param_counts(cfg)
    assert count_parameters(model, ParallelState()) == counts.total
    one = 3 * 32 * 32
    assert counts.total - counts.active == 2 * (4 - 2) * one  # two MoE layers, 2 of 4 experts unused per token
    assert not isinstance(model.layers["0"].mlp, MoELayer) and isinstance(model.layers["1"].mlp, MoELayer)


def _problems(world: int, *flags: str) -> str:
    try:
        validate(resolve(parse_args(list(flags)), world), world)
    except ConfigError as e:
        return str(e)
    return ""


def test_bad_moe_input_is_one_line() -> None:
    base = ["--model.preset", "tiny-moe"]
    assert _problems(1, *base) == ""
    assert _problems(4, *base, "--parallel.ep", "2", "--parallel.tp", "2") == ""
    top_k = _problems(1, *base, "--moe.top_k", "9")
    assert "moe.top_k 9 must be between 1 and moe.experts 8" in top_k and "group" not in top_k  # one problem
    assert "leaves no MoE layer among the 4" in _problems(1, *base, "--moe.first_dense", "4")
    assert "moe.route_scale must be > 0" in _problems(1, *base, "--moe.route_scale", "0")
    assert "does not divide dp x cp" in _problems(3, *base, "--parallel.ep", "2")
    assert "moe.experts 8 is not divisible by parallel.ep 3" in _problems(3, *base, "--parallel.ep", "3")
    assert "moe.capacity_factor must be > 0" in _problems(1, *base, "--moe.capacity_factor", "0")
    assert "needs a mixture-of-experts model" in _problems(2, "--parallel.ep", "2")
    assert "not one of mixtral, qwen3, deepseek" in _problems(1, *base, "--moe.router", "switch")
