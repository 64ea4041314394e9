"""The elementwise / fused ops and the loss the model uses, from one of two interchangeable backends.

`torch`: plain PyTorch (any device). `triton`: the fused kernels in the top-level `kernels`
package (CUDA, or the CPU interpreter under TRITON_INTERPRET=1). Both fill the same `Ops` record, so
the model code never branches on the backend nor imports a kernel. Activations are [batch, seq, heads,
head_dim] for q/k/v, [batch, seq, hidden] (or a sequence slice of it under SP) for the norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.attention.blocks import Backend
from megalite.attention.local import sdpa
from megalite.errors import ConfigError
from megalite.layers.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel import comm
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor


class _RMSNorm(torch.autograd.Function):
    """y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps) per row, in fp32 whatever x's dtype.

    Saves x (its own dtype), w and the per-row rstd; backward recomputes x_hat = x * rstd and uses
    dx = rstd * (g w - x_hat * mean(g w x_hat)), dw = sum over rows of g x_hat: about half the time of
    autograd over the expression on CPU (fewer passes, no saved fp32 temporaries)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        gf = g.float()
        dw = (gf * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gw = gf * weight.float()
        dx = gw.sub_(x_hat.mul_((gw * x_hat).mean(dim=-1, keepdim=True))).mul_(rstd)
        return dx.to(x.dtype), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _RMSNorm.apply(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): a pre-norm block's residual add and the norm that reads it.
    Two passes here; one in the Triton backend (`kernels.add_rms_norm`)."""
    s = residual + x
    return rms_norm(s, weight, eps), s


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(layer_norm(x + residual), x + residual); see `add_rms_norm`."""
    s = residual + x
    return layer_norm(s, weight, bias, eps), s


def _rotate(x: Tensor, c: Tensor, s: Tensor, sign: float) -> Tensor:
    """x * c + sign * swap(x) * s in fp32, with c = [cos, cos] and s = [-sin, sin] ([1, S, 1, D]) and
    swap([x1, x2]) = [x2, x1]: that is [x1 cos - x2 sin, x2 cos + x1 sin] for sign 1 and the inverse
    rotation for sign -1. Whole-row ops on contiguous tensors (twice as fast on CPU as four ops on
    strided halves); one copy (the swap) where autograd over the expression makes two cats."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c).addcmul_(torch.cat([x2, x1], dim=-1), s, value=sign).to(x.dtype)


class _Rope(torch.autograd.Function):
    """A rotation of each (x1, x2) pair: its backward is the inverse rotation of the gradient, so
    nothing of x is saved."""

    @staticmethod
    def forward(ctx, x: Tensor, c: Tensor, s: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s, 1.0)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        c, s = ctx.saved_tensors
        return _rotate(g, c, s, -1.0), None, None


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE (Su et al. 2021; Hugging Face Llama's layout); cos/sin are [S, D/2] fp32, or [B, S, D/2]
    (per-sequence positions: document masking restarts them at each document)."""
    c = torch.cat([cos, cos], dim=-1).unsqueeze(-2)
    s = torch.cat([-sin, sin], dim=-1).unsqueeze(-2)
    if c.dim() == 3:
        c, s = c[None], s[None]
    return _Rope.apply(q, c, s), _Rope.apply(k, c, s)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# SDPA reads grouped kv heads itself from torch 2.5 on (`enable_gqa`); older versions need them repeated.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """Causal grouped-query attention via SDPA; q [B,S,Hq,D], k/v [B,S,Hk,D] -> [B,S,Hq,D].

    Query head h reads kv head h // (Hq/Hk). With `enable_gqa` SDPA does that without materialising
    Hq/Hk copies of K and V and of their gradients (memory on any device; on CPU the time saved was
    within the noise of bench/cpu_compare.py, 0-3% of a step). Same numbers as repeating the heads.
    """
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and not _SDPA_HAS_GQA:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    gqa: dict[str, Any] = {"enable_gqa": True} if rep > 1 and _SDPA_HAS_GQA else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), **gqa)
    return out.transpose(1, 2)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """`attention` under any mask: `keep` [B, 1, Sq, Sk] bool, True where query i sees key j (document masking,
    megalite/context/documents.py). SDPA (megalite/attention/local.py); every query row must keep a key."""
    return sdpa(q, k, v, keep, 1.0 / math.sqrt(q.shape[-1]))


# Per-token loss [N] (fp32) from this rank's logit columns [N, padded_vocab/tp], the labels [N], the layout
# (its 'tp' group reduces the row statistics) and the real vocabulary size (columns past it are padding).
VocabParallelLoss = Callable[[Tensor, Tensor, ParallelState, int], Tensor]


@dataclass(frozen=True)
class Ops:
    """Everything backend-specific the model calls; see each torch function above for the contract."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    layer_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    add_layer_norm: Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    apply_rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    swiglu: Callable[[Tensor, Tensor], Tensor]
    gelu_tanh: Callable[[Tensor], Tensor]
    attention: Callable[..., Tensor]
    cross_entropy: VocabParallelLoss
    block_backend: Backend = "torch"  # the context-parallel ring's per-block attention (megalite/context)
    # Causal attention within documents, (q, k, v, document ids [B, S]) -> out, when the backend has a kernel
    # for it (the flash kernel's segment ids); None: masked SDPA under the explicit mask (data.document_mask).
    document_attention: Optional[Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = None


TORCH_OPS = Ops(rms_norm, layer_norm, add_rms_norm, add_layer_norm, apply_rope, swiglu, gelu_tanh, attention,
                vocab_parallel_cross_entropy)


def _kernel_loss(kernel: Callable[..., Tensor]) -> VocabParallelLoss:
    """The Triton vocab-parallel cross-entropy (online softmax, gradient written into the logits) behind
    the torch loss's signature: it is given only the real columns of this rank's shard, and reduces its
    row statistics through `comm` (counted under 'tp', the same bytes as the torch loss)."""

    def loss(logits: Tensor, labels: Tensor, state: ParallelState, vocab_size: int) -> Tensor:
        start = state.tp_rank * logits.shape[1]
        real = max(0, min(logits.shape[1], vocab_size - start))  # drop padded columns
        if real < logits.shape[1]:
            logits = logits[:, :real].contiguous()
        return kernel(logits, labels, start,
                      lambda t: comm.all_reduce(t, state, "tp", op=dist.ReduceOp.MAX),
                      lambda t: comm.all_reduce(t, state, "tp"))

    return loss


def get_ops(kind: str) -> Ops:
    """`torch` or `triton` (`auto` must be resolved by the caller from the device)."""
    if kind == "torch":
        return TORCH_OPS
    if kind == "triton":
        try:
            from megalite import kernels
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ConfigError(f"model.kernels=triton but the kernels package failed to import: {e}") from e
        if not kernels.available():
            raise ConfigError("model.kernels=triton needs CUDA or TRITON_INTERPRET=1 with triton installed; "
                              "use model.kernels=torch")
        return Ops(kernels.rms_norm, kernels.layer_norm, kernels.add_rms_norm, kernels.add_layer_norm,
                   kernels.apply_rope, kernels.swiglu, kernels.gelu_tanh, kernels.flash_attention,
                   _kernel_loss(kernels.vocab_parallel_cross_entropy), block_backend="triton",
                   document_attention=lambda q, k, v, ids: kernels.flash_attention(q, k, v, True, None, ids))
    raise ConfigError(f"model.kernels={kind!r}: expected torch, triton or auto")


def resolve_kernels(kind: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA, torch elsewhere."""
    if kind == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return kind
