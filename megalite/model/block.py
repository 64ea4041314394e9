"""One transformer block, TP/SP-aware: norm -> attention -> residual, norm -> MLP -> residual.

llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.
gpt2:  LayerNorm with bias, learned positions (in the embedding), GeLU(tanh) MLP, biases.

Under TP the attention is split by heads (each rank: num_heads/tp query heads and num_kv_heads/tp
kv heads) and the MLP column-then-row (Megatron-LM section 3), so each block needs one collective
forward at each of its two exits and one backward at each entry. Under SP (tp>1) the norms,
residuals and dropout run on a 1/tp slice of the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megalite.attention.variant import PLAIN
from megalite.context.attend import Masking
from megalite.context.options import ContextOptions
from megalite.context.documents import DocumentIds
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from megalite.mla.attention import MLAContext, MLAttention
from megalite.model.attend import attend
from megalite.model.ops import Ops, apply_rope
from megalite.model.spec import ModelSpec, head_dim
from megalite.moe.layer import MoEContext, MoELayer
from megalite.parallel.param_spec import REPLICATED, ParamSpec
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState


class Norm(nn.Module):
    """RMSNorm (llama) or LayerNorm with bias (gpt2); weights replicated across TP ranks."""

    def __init__(self, hidden: int, arch: str, eps: float, state: ParallelState, ops: Ops) -> None:
        super().__init__()
        self.eps, self.ops, self.arch = eps, ops, arch
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden)) if arch == "gpt2" else None
        self.sp = state.sp

    def param_specs(self) -> dict[str, ParamSpec]:
        # Replicated; under SP each rank sees 1/tp of the sequence, so the grads are partial sums over TP.
        spec = ParamSpec(REPLICATED, sp_partial=self.sp)
        return {"weight": spec} if self.bias is None else {"weight": spec, "bias": spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self.ops.rms_norm(x, self.weight.to(x.dtype), self.eps)
        return self.ops.layer_norm(x, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one pass over the residual stream with the Triton backend."""
        if self.bias is None:
            return self.ops.add_rms_norm(x, residual, self.weight.to(x.dtype), self.eps)
        return self.ops.add_layer_norm(x, residual, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class HeadNorm(nn.Module):
    """RMSNorm over each head's head_dim (Qwen3's q_norm / k_norm): one [head_dim] weight shared by every head.

    Per head, so the forward needs nothing from other ranks; but each TP rank holds other heads, so its
    weight gradient is a partial sum over TP (all-reduced there like SP's norms: `sp_partial`)."""

    def __init__(self, head_dim: int, eps: float, state: ParallelState, ops: Ops) -> None:
        super().__init__()
        self.eps, self.ops, self.tp = eps, ops, state.tp
        self.weight = nn.Parameter(torch.ones(head_dim))

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec(REPLICATED, sp_partial=self.tp > 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, name: str, seed: int,
                 context: ContextOptions = ContextOptions()) -> None:
        super().__init__()
        self.context = context
        h, nh, nkv = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        if nh % state.tp or nkv % state.tp:
            raise ValueError(f"num_heads={nh} and num_kv_heads={nkv} must both be divisible by tp={state.tp}")
        self.head_dim = head_dim(cfg)
        self.local_heads, self.local_kv = nh // state.tp, nkv // state.tp
        self.state, self.ops, self.rope = state, ops, cfg.arch == "llama"
        self.selective = cfg.recompute == "selective"
        bias = cfg.arch == "gpt2"
        self.qkv = ColumnParallelLinear(h, [nh * self.head_dim, nkv * self.head_dim, nkv * self.head_dim],
                                        state, name=f"{name}.qkv", seed=seed, std=cfg.init_std,
                                        bias=bias, input_ready=True)
        # Scaled init of residual-branch outputs (GPT-2 / Megatron): std / sqrt(2 * num_layers).
        self.out = RowParallelLinear(nh * self.head_dim, h, state, name=f"{name}.out", seed=seed,
                                     std=cfg.init_std / math.sqrt(2 * cfg.num_layers), bias=bias)
        self.q_norm: HeadNorm | None = None
        self.k_norm: HeadNorm | None = None
        if cfg.qk_norm:  # model.qk_norm (Qwen3)
            self.q_norm = HeadNorm(self.head_dim, cfg.norm_eps, state, ops)
            self.k_norm = HeadNorm(self.head_dim, cfg.norm_eps, state, ops)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [b, s, heads, head_dim] (this rank's heads), RoPE applied at the positions whose
        cos/sin rows are given (one per token of x; the KV-cached decoder passes later positions)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = k.view(b, s, self.local_kv, self.head_dim)
        v = v.view(b, s, self.local_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = (rope or self.ops.apply_rope)(q, k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> torch.Tensor:
        x = enter_tp_region(x, self.state)
        b, s, _ = x.shape
        if docs is not None:
            # Document masking (megalite/context/documents.py): cos/sin are per sequence [b, s, d/2] (positions
            # restart at each document) and the mask is causal within each document. Torch RoPE (the kernel takes
            # no per-document positions).
            q, k, v = self.project(x, cos, sin, rope=apply_rope)
        else:
            q, k, v = self.project(x, cos[:s], sin[:s])
        o = attend(q, k, v, Masking(docs, PLAIN), self.state, self.context, self.ops, self._run)
        return self.out(o.reshape(b, s, self.local_heads * self.head_dim))

    def _run(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        if self.selective and torch.is_grad_enabled():
            # Selective recompute (Korthikanti et al. 2022): drop the s^2 attention internals.
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


class MLP(nn.Module):
    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, name: str, seed: int) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.state, self.ops, self.gated = state, ops, cfg.arch == "llama"
        bias = cfg.arch == "gpt2"
        parts = [f, f] if self.gated else [f]  # SwiGLU: gate and up fused in one column linear
        self.up = ColumnParallelLinear(h, parts, state, name=f"{name}.up", seed=seed, std=cfg.init_std,
                                       bias=bias, input_ready=True)
        self.down = RowParallelLinear(f, h, state, name=f"{name}.down", seed=seed,
                                      std=cfg.init_std / math.sqrt(2 * cfg.num_layers), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = self.up(enter_tp_region(x, self.state))
        y = self.ops.swiglu(*ys) if self.gated else self.ops.gelu_tanh(ys[0])
        return self.down(y)


@dataclass(frozen=True)
class BlockFeatures:
    """The optional parts a block is built with: a MoE feed-forward (`moe`), multi-head latent attention (`mla`)."""

    moe: MoEContext | None = None
    mla: MLAContext | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, rng: RNGStreams, index: int, seed: int,
                 context: ContextOptions = ContextOptions(), features: BlockFeatures = BlockFeatures()) -> None:
        super().__init__()
        moe, mla = features.moe, features.mla
        name = f"layers.{index}"
        self.norm1 = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops)
        self.attn: nn.Module = (Attention(cfg, state, ops, f"{name}.attn", seed, context) if mla is None  # MLA:
                                else MLAttention(cfg, mla, state, ops, f"{name}.attn", seed, context))  # megalite/mla
        self.norm2 = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops)
        self.mlp: nn.Module
        if moe is not None and moe.settings.is_moe_layer(index):  # the FFN is a mixture of experts (megalite/moe)
            self.mlp = MoELayer(cfg, moe, state, ops, f"{name}.mlp", seed, MLP)
        else:
            self.mlp = MLP(cfg, state, ops, f"{name}.mlp", seed)
        self.dropout, self.rng, self.sp = cfg.dropout, rng, state.sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # On SP slices each TP rank holds different tokens: draw from the tp-local stream.
        return self.rng.dropout(x, self.dropout, self.training, tp_local=self.sp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> torch.Tensor:
        # x = x + attention branch; h = norm2(x): fused into one pass (the sum is written once and read by
        # the norm in the same kernel) when the backend has the fused kernel.
        h, x = self.norm2.add_norm(self._drop(self.attn(self.norm1(x), cos, sin, docs)), x)
        return x + self._drop(self.mlp(h))
