"""The elementwise / fused ops the model uses, from one of two interchangeable backends.

`torch`: plain PyTorch (any device). `triton`: the fused kernels in the top-level `kernels`
package (CUDA, or the CPU interpreter under TRITON_INTERPRET=1). Both share signatures, so the
model code never branches on the backend. Activations are [batch, seq, heads, head_dim] for q/k/v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megalite.errors import ConfigError

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE (Su et al. 2021; Hugging Face Llama's layout); cos/sin are [S, D/2] fp32."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]

    def rot(x: Tensor) -> Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


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
    gqa = {"enable_gqa": True} if rep > 1 and _SDPA_HAS_GQA else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), **gqa)
    return out.transpose(1, 2)


def attention_repeat_kv(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """The same attention with K/V heads repeated before SDPA (the pre-2.5 path), kept as a baseline
    for bench/gpu_bench.py's flash-vs-SDPA table."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2)


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    layer_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]
    apply_rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    swiglu: Callable[[Tensor, Tensor], Tensor]
    gelu_tanh: Callable[[Tensor], Tensor]
    attention: Callable[..., Tensor]


TORCH_OPS = Ops(rms_norm, layer_norm, apply_rope, swiglu, gelu_tanh, attention)


def get_ops(kind: str) -> Ops:
    """`torch` or `triton` (`auto` must be resolved by the caller from the device)."""
    if kind == "torch":
        return TORCH_OPS
    if kind == "triton":
        try:
            import kernels
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ConfigError(f"model.kernels=triton but the kernels package failed to import: {e}") from e
        if not kernels.available():
            raise ConfigError("model.kernels=triton needs CUDA or TRITON_INTERPRET=1 with triton installed; "
                              "use model.kernels=torch")
        return Ops(kernels.rms_norm, kernels.layer_norm, kernels.apply_rope, kernels.swiglu,
                   kernels.gelu_tanh, kernels.flash_attention)
    raise ConfigError(f"model.kernels={kind!r}: expected torch, triton or auto")


def resolve_kernels(kind: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA, torch elsewhere."""
    if kind == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return kind
