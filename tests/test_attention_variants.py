"""One rank (cp = 1): every path of megalite/attention/local.py against `reference_attention`, the definition
(forward, dq, dk, dv and d sinks), with GQA, documents and the window together; and the block math's pieces
(soft-cap backward, sinks as a log-sum-exp rescale) against autograd.

Tolerance 2e-5 (absolute and relative), as tests/test_context_parallel.py: the paths compute in fp32 (SDPA, the
block math) against the reference's fp32 autograd evaluated in fp64 inputs; observed ~1e-6 on values of order
1, while a window off by one, a sink counted twice or missing the soft-cap's 1 - tanh^2 gives errors of order
1e-2-1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megalite.attention.local import variant_attention
from megalite.attention.variant import AttentionVariant, reference_attention

TOL: dict[str, Any] = dict(atol=2e-5, rtol=2e-5)
SEQ, HEADS, KV_HEADS, D = 16, 4, 2, 8


def problem(seed: int, batch: int = 2, seq: int = SEQ, heads: int = HEADS, kv_heads: int = KV_HEADS,
            d: int = D) -> list[torch.Tensor]:
    """q, k, v, an upstream gradient and sink logits away from zero, fp64."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq, heads, d), (batch, seq, kv_heads, d), (batch, seq, kv_heads, d), (batch, seq, heads, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] + [
        torch.randn(heads, generator=g, dtype=torch.float64) * 2]


def doc_ids(batch: int, seq: int) -> torch.Tensor:
    """Documents of uneven lengths, different per sequence (boundaries where windows and chunks cut)."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        for cut in ([5, 11] if b == 0 else [3, 9, 13])[: seq]:
            ids[b, cut:] += 1
    return ids


VARIANTS: dict[str, dict[str, Any]] = {
    "window": dict(window=5),
    "window1": dict(window=1),
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=2.0),
    "scale": dict(scale=0.2),
    "all": dict(window=6, sinks=True, softcap=3.0, scale=0.5),
}


def make_variant(name: str, sinks: torch.Tensor) -> AttentionVariant:
    spec = dict(VARIANTS[name])
    with_sinks = bool(spec.pop("sinks", False))
    return AttentionVariant(sinks=sinks if with_sinks else None, **spec)


def grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient (zeros where autograd gave none: a sink no path used)."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, sinks: torch.Tensor,
                    name: str, docs: torch.Tensor | None) -> list[torch.Tensor]:
    """`reference_attention` and its autograd gradients, fp64: out, dq, dk, dv, d sinks (zeros without sinks)."""
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    pos = torch.arange(q.shape[1])
    out = reference_attention(q, k, v, make_variant(name, sinks), pos, pos, docs, docs)
    out.backward(d_out)
    return [out.detach(), grad(q), grad(k), grad(v), grad(sinks)]


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("with_docs", [False, True])
def test_torch_variant_attention_equals_the_reference(name: str, with_docs: bool) -> None:
    q, k, v, d_out, sinks = problem(1)
    docs = doc_ids(2, SEQ) if with_docs else None
    want = reference_grads(q, k, v, d_out, sinks, name, docs)
    qf, kf, vf, sf = (t.float().requires_grad_() for t in (q, k, v, sinks))
    out = variant_attention(qf, kf, vf, make_variant(name, sf), docs, "torch")
    out.backward(d_out.float())
    got = [out.detach(), grad(qf), grad(kf), grad(vf), grad(sf)]
    for label, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m: f"{label}: {m}")


def test_the_window_convention_is_transformers() -> None:
    """W keys counting the query's own: with W = 1 each token sees only itself (output = its own value row)."""
    q, k, v, _, _ = problem(2, heads=2, kv_heads=2)
    out = variant_attention(q.float(), k.float(), v.float(), AttentionVariant(window=1), None, "torch")
    torch.testing.assert_close(out, v.float(), **TOL)


def test_a_sink_only_shrinks_each_row_by_sigmoid_of_its_lse() -> None:
    """O' = O sigmoid(L - sink): the LSE form the kernels and the cp modes apply after merging the blocks."""
    q, k, v, _, sinks = problem(3)
    plain = variant_attention(q, k, v, AttentionVariant(scale=1 / D ** 0.5), None, "torch")
    with_sinks = variant_attention(q, k, v, AttentionVariant(sinks=sinks), None, "torch")
    rep = HEADS // KV_HEADS
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) / D ** 0.5
    s = s.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    factor = torch.sigmoid(torch.logsumexp(s, -1) - sinks.view(1, -1, 1)).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(with_sinks, plain * factor, **TOL)


def test_window_and_sinks_are_transformers_gpt_oss() -> None:
    """The oracle: transformers' gpt-oss eager attention (sinks concatenated to the logits, then dropped) under its
    sliding-window causal mask function (kv_idx > q_idx - W), forward and every gradient, sinks included."""
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    window = 5
    q, k, v, d_out, sinks = problem(11)
    visible = sliding_window_causal_mask_function(window)
    idx = torch.arange(SEQ)
    allowed = visible(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).expand(SEQ, SEQ)
    bias = torch.zeros(SEQ, SEQ, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    hq, hs = [t.clone().requires_grad_() for t in (q, k, v)], sinks.clone().requires_grad_()
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=hs, training=False)
    hq_, hk_, hv_ = (t.transpose(1, 2) for t in hq)
    want, _ = eager_attention_forward(module, hq_, hk_, hv_, bias, D ** -0.5)  # type: ignore[arg-type]
    want.backward(d_out)
    qf, kf, vf, sf = (t.float().requires_grad_() for t in (q, k, v, sinks))
    got = variant_attention(qf, kf, vf, AttentionVariant(window=window, sinks=sf), None, "torch")
    got.backward(d_out.float())
    for label, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], [got.detach(), grad(qf), grad(kf), grad(vf), grad(sf)],
                           [want.detach(), *(grad(t) for t in hq), grad(hs)]):
        torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m: f"{label}: {m}")


def test_window_softcap_and_scale_are_transformers_gemma2() -> None:
    """The oracle for the soft-cap: transformers' Gemma 2 eager attention (tanh soft-cap after scaling, before
    the mask; its own scale, as query_pre_attn_scalar gives) under the sliding-window mask, forward and grads."""
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    window, softcap, scale = 6, 1.5, 0.3
    q, k, v, d_out, _ = problem(12)
    idx = torch.arange(SEQ)
    allowed = sliding_window_causal_mask_function(window)(torch.tensor(0), torch.tensor(0), idx[:, None],
                                                          idx[None, :]).expand(SEQ, SEQ)
    bias = torch.zeros(SEQ, SEQ, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    hq = [t.clone().requires_grad_() for t in (q, k, v)]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, head_dim=D, training=False)
    hq_, hk_, hv_ = (t.transpose(1, 2) for t in hq)
    want, _ = eager_attention_forward(module, hq_, hk_, hv_, bias, scaling=scale,  # type: ignore[arg-type]
                                      softcap=softcap)
    want.backward(d_out)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    got = variant_attention(qf, kf, vf, AttentionVariant(window=window, softcap=softcap, scale=scale), None, "torch")
    got.backward(d_out.float())
    for label, a, b in zip(["out", "dq", "dk", "dv"], [got.detach(), grad(qf), grad(kf), grad(vf)],
                           [want.detach(), *(grad(t) for t in hq)]):
        torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m: f"{label}: {m}")
