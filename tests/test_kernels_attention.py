"""Flash attention (causal / full, grouped-query) vs materialised fp32 attention, in the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest
import torch

pytest.importorskip("triton")
from megalite.kernels.testing import check_against_reference, use_interpreter  # noqa: E402

K = use_interpreter()

# Tolerances, per input dtype (the reference materialises softmax(QK^T)V in fp32 on the same values):
# - fp32: the kernel accumulates in fp32 too, in blocks of 16 keys with online rescaling, and
#   recomputes P in backward from the saved logsumexp: reordered sums of <= 40 terms, ~1e-6 on
#   values of order 1; 2e-5 absolute and relative.
# - bf16: as on tensor cores, P (forward) and dS (backward) are rounded to bf16 before their
#   matmuls and every output is rounded to bf16 on store (relative step 2^-8, 2^-7 with the
#   interpreter's truncation). Sums of up to 40 such terms mostly average out; 4e-2 holds with
#   margin while a wrong mask, scale or head mapping gives errors of order 1.
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}
DTYPES = [torch.float32, torch.bfloat16]
# (B, S, Hq, Hk, D): regular (two full 16-blocks); GQA 4:2 with S=37 (masked tail block);
# one token; MQA with head_dim 8 (padded to the 16-wide dot) and the batch of 2 (batch strides). One
# sequence elsewhere: the interpreter's cost grows with the programs, B x heads x query blocks (suite time).
SHAPES = [(1, 32, 4, 4, 16), (1, 37, 4, 2, 16), (1, 1, 2, 1, 16), (2, 19, 2, 1, 8)]


def _qkv(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, Hq, Hk, D = shape
    g = torch.Generator().manual_seed(S * Hq)
    q = (1.5 * torch.randn(B, S, Hq, D, generator=g)).to(dtype)  # sharp enough softmax to test masking
    k = (1.5 * torch.randn(B, S, Hk, D, generator=g)).to(dtype)
    v = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_flash_attention(shape: tuple[int, ...], dtype: torch.dtype, causal: bool) -> None:
    q, k, v = _qkv(shape, dtype)
    tol = TOL[dtype]
    check_against_reference(K.flash_attention, K.flash_attention_reference, (q, k, v, causal), [0, 1, 2], tol, tol)


def test_custom_softmax_scale() -> None:
    q, k, v = _qkv((1, 21, 2, 2, 16), torch.float32)
    check_against_reference(K.flash_attention, K.flash_attention_reference, (q, k, v, True, 0.5), [0, 1, 2],
                            2e-5, 2e-5)


def test_reference_matches_torch_sdpa() -> None:
    """The reference itself (GQA head mapping h -> h // (Hq/Hk), causal mask) against torch's SDPA."""
    q, k, v = _qkv((2, 13, 4, 2, 16), torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    torch.testing.assert_close(K.flash_attention_reference(q, k, v, True), expected, atol=1e-5, rtol=1e-5)


def test_rejects_bad_head_counts() -> None:
    q, k, v = _qkv((1, 4, 3, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        K.flash_attention(q, k, v)


# ---------------------------------------------------------------- one block of a longer attention: (O, LSE)
# (B, SQ, SK, Hq, Hk, D, causal): the three block shapes of ring attention (megalite/context/ring.py) with
# zigzag chunks of 5 tokens: the diagonal block (causal, square), all queries x the first key chunk, the
# last query chunk x all keys; grouped-query 4:2, and MQA 3:1 with head_dim 8 and a 17-row query block
# (two 16-row kernel blocks, the second masked).
BLOCK_SHAPES = [(2, 10, 10, 4, 2, 16, True), (2, 10, 5, 4, 2, 16, False), (1, 5, 10, 4, 2, 16, False),
                (1, 17, 6, 3, 1, 8, False)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_flash_block_returns_lse(shape: tuple) -> None:
    """O and the natural-log LSE over this block's keys, fp32, vs the materialised reference. Tolerance as
    `TOL[fp32]`: the LSE is m + log(l) of the same online softmax, as exact as O."""
    B, SQ, SK, Hq, Hk, D, causal = shape
    g = torch.Generator().manual_seed(SQ * SK + Hq)
    q = 1.5 * torch.randn(B, SQ, Hq, D, generator=g)
    k, v = 1.5 * torch.randn(B, SK, Hk, D, generator=g), torch.randn(B, SK, Hk, D, generator=g)
    out, lse = K.flash_attention_block(q, k, v, causal)
    ref_out, ref_lse = K.flash_attention_block_reference(q, k, v, causal)
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (B, Hq, SQ)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_flash_block_mask_in_global_positions() -> None:
    """The all-gather form's mask: rank 1's zigzag queries of a 12-token sequence at cp = 2 (positions
    3-8) against every rank's keys in rank order (positions 0 1 2 9 10 11 3 ... 8), key visible iff its
    position <= the query's; forward (O, LSE) and the backward from the block's own LSE (the whole softmax
    here) vs autograd through the reference. GQA 4:2; tolerance as above."""
    g = torch.Generator().manual_seed(5)
    q_pos, k_pos = torch.arange(3, 9), torch.tensor([0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8])
    q = torch.randn(2, 6, 4, 16, generator=g)
    k, v = torch.randn(2, 12, 2, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    out, lse = K.flash_attention_block(q, k, v, False, positions=(q_pos, k_pos))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = K.flash_attention_block_reference(*leaves, False, positions=(q_pos, k_pos))
    d_out = torch.randn(ref_out.shape, generator=g)
    ref_out.backward(d_out)
    delta = (d_out * ref_out.detach()).sum(-1).transpose(1, 2)
    grads = K.flash_attention_block_backward(q, k, v, d_out, ref_lse.detach(), delta, False,
                                             positions=(q_pos, k_pos))
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads],
                               [ref_out, ref_lse] + [t.grad for t in leaves]):
        torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


def test_flash_block_rejects_non_square_causal() -> None:
    q, k = torch.zeros(1, 4, 2, 16), torch.zeros(1, 6, 2, 16)
    with pytest.raises(ValueError, match="causal block must be square"):
        K.flash_attention_block(q, k, k, True)


# ---------------------------------------------------------------- document masking (segment ids)
def _segments(B: int, lengths: list[int]) -> torch.Tensor:
    """[B, S] document ids of documents of `lengths` (every sequence alike)."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).repeat(B, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_document_mask_matches_the_torch_path(causal: bool) -> None:
    """Documents of 5, 20 and 12 tokens (boundaries inside 16-wide tiles, one tile of three documents' tail
    and head), GQA 4:2, fp32: forward and dq/dk/dv against the torch path's masked SDPA (megalite.model.ops,
    what the model runs under data.document_mask) and the materialised reference. Tolerance as fp32 above.
    One sequence: every row would get the same documents (batch strides: test_flash_attention's shape 3)."""
    from megalite.context.documents import document_causal_mask
    from megalite.model.ops import masked_attention

    q, k, v = _qkv((1, 37, 4, 2, 16), torch.float32)
    seg = _segments(1, [5, 20, 12])
    torch_path = (lambda q_, k_, v_: masked_attention(q_, k_, v_, document_causal_mask(seg, seg, causal))) \
        if causal else (lambda q_, k_, v_: K.flash_attention_reference(q_, k_, v_, False, None, seg))
    check_against_reference(lambda q_, k_, v_: K.flash_attention(q_, k_, v_, causal, None, seg), torch_path,
                            (q, k, v), [0, 1, 2], 2e-5, 2e-5)
    unmasked = K.flash_attention_reference(q, k, v, causal)
    assert (unmasked - K.flash_attention(q, k, v, causal, None, seg)).abs().max() > 1e-2  # the mask matters


def test_flash_attention_skips_tiles_no_document_crosses() -> None:
    """Three documents of exactly one 16-wide tile each: a skipped tile is never read. Document 0's values and
    output gradient are NaN; documents 1 and 2 would see NaN through 0 * NaN in any tile pairing them with
    document 0 that was computed (masked scores still multiply V and dO), so their outputs and every gradient
    of theirs stay finite only if those tiles are skipped, forward, dQ and dK/dV alike."""
    q, k, v = _qkv((1, 48, 2, 2, 16), torch.float32)
    seg = _segments(1, [16, 16, 16])
    v[:, :16] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = K.flash_attention(q, k, v, True, None, seg)
    d_out = torch.randn_like(out)
    d_out[:, :16] = float("nan")
    out.backward(d_out)
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t[:, 16:]).all(), f"{name}: a fully masked tile was computed"
    assert torch.isnan(out[:, :16]).all()  # the poison is there: the test can fail
