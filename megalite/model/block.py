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

from megalite.attention.variant import AttentionVariant
from megalite.context.attend import Masking
from megalite.context.options import ContextOptions
from megalite.context.documents import DocumentIds
from megalite.layers.activation import MLPActivation
from megalite.layers.init import full_normal
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from megalite.mla.attention import MLAContext, MLAttention
from megalite.model.attend import attend
from megalite.model.ops import Ops, apply_rope
from megalite.model.linear_mixer import LinearMixer
from megalite.model.mamba_mixer import Mamba2Mixer
from megalite.model.pattern import (LINEAR_MIXERS, MAMBA, LayerSpec, gate_width, has_attention_bias, has_mlp_bias,
                                    layer_spec, mlp_kind, softmax_scale)
from megalite.model.spec import ModelSpec, head_dim
from megalite.moe.layer import MoEContext, MoELayer
from megalite.parallel.param_spec import REPLICATED, ParamSpec, children_specs, column
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
    """Grouped-query attention of one layer under its variant (megalite/model/pattern.py `LayerSpec` and the
    model.attn_* fields): window, sinks, soft-cap, softmax scale, partial / no RoPE, output gate, biases."""

    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, name: str, seed: int,
                 context: ContextOptions = ContextOptions(), layer: LayerSpec = LayerSpec()) -> None:
        super().__init__()
        self.context = context
        h, nh, nkv = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        if nh % state.tp or nkv % state.tp:
            raise ValueError(f"num_heads={nh} and num_kv_heads={nkv} must both be divisible by tp={state.tp}")
        self.head_dim = hd = head_dim(cfg)
        self.local_heads, self.local_kv = nh // state.tp, nkv // state.tp
        # RoPE on the first `rotary` dims of each head (all: rotary == head_dim; NoPE: 0; gpt2: learned positions)
        self.rotary = layer.rotary_dim(hd) if cfg.arch == "llama" else 0
        self.state, self.ops, self.rope = state, ops, self.rotary > 0
        self.selective = cfg.recompute == "selective"
        bias = has_attention_bias(cfg)
        # The output gate (Qwen3-Next) is one more part of the fused q/k/v projection: per element or per head.
        self.gate = cfg.attn_output_gate
        gate = gate_width(nh, hd, self.gate)
        self.qkv = ColumnParallelLinear(h, [nh * hd, nkv * hd, nkv * hd] + ([gate] if gate else []),
                                        state, name=f"{name}.qkv", seed=seed, std=cfg.init_std,
                                        bias=bias, input_ready=True)
        # Scaled init of residual-branch outputs (GPT-2 / Megatron): std / sqrt(2 * num_layers).
        self.out = RowParallelLinear(nh * hd, h, state, name=f"{name}.out", seed=seed,
                                     std=cfg.init_std / math.sqrt(2 * cfg.num_layers), bias=bias)
        self.q_norm: HeadNorm | None = None
        self.k_norm: HeadNorm | None = None
        if cfg.qk_norm:  # model.qk_norm (Qwen3)
            self.q_norm = HeadNorm(hd, cfg.norm_eps, state, ops)
            self.k_norm = HeadNorm(hd, cfg.norm_eps, state, ops)
        # gpt-oss's sinks: one logit per query head, drawn in full and split with the heads (any tp: same numbers).
        self.sinks: nn.Parameter | None = None
        if cfg.attn_sinks:
            full = full_normal((nh,), cfg.init_std, seed, f"{name}.sinks")
            self.sinks = nn.Parameter(full[state.tp_rank * self.local_heads:(state.tp_rank + 1) * self.local_heads])
        self.window = layer.window
        self.softcap = cfg.attn_softcap or None
        self.scale = softmax_scale(cfg)
        self.num_heads = nh

    def param_specs(self) -> dict[str, ParamSpec]:
        specs = children_specs(self)
        if self.sinks is not None:  # split over tp with the query heads, like a column linear's bias
            specs["sinks"] = ParamSpec(column([self.num_heads]))
        return specs

    def variant(self) -> AttentionVariant:
        """What this layer's attention computes beyond causal softmax(q k^T / sqrt(d)) v (megalite/attention)."""
        return AttentionVariant(self.window, self.softcap, self.scale, self.sinks)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v as [b, s, heads, head_dim] (this rank's heads), RoPE applied at the positions whose
        cos/sin rows are given (one per token of x; the KV-cached decoder passes later positions), and the
        output gate's logits (None without one)."""
        b, s, _ = x.shape
        q, k, v, *gate = self.qkv(x)
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = k.view(b, s, self.local_kv, self.head_dim)
        v = v.view(b, s, self.local_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = self._rotate(q, k, cos, sin, rope or self.ops.apply_rope)
        return q, k, v, (gate[0] if gate else None)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the first `rotary` dims of each head (transformers' partial_rotary_factor), the rest passed."""
        r = self.rotary
        if r == self.head_dim:
            return rope(q, k, cos, sin)
        qr, kr = rope(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        return torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)

    def finish(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The output projection of the attention rows o [b, s, heads, head_dim], times sigmoid(gate) if any."""
        b, s = o.shape[:2]
        if gate is not None:
            o = o * torch.sigmoid(gate).view(b, s, self.local_heads, -1).to(o.dtype)
        return self.out(o.reshape(b, s, self.local_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> torch.Tensor:
        x = enter_tp_region(x, self.state)
        s = x.shape[1]
        if docs is not None:
            # Document masking (megalite/context/documents.py): cos/sin are per sequence [b, s, d/2] (positions
            # restart at each document) and the mask is causal within each document. Torch RoPE (the kernel takes
            # no per-document positions).
            q, k, v, gate = self.project(x, cos, sin, rope=apply_rope)
        else:
            q, k, v, gate = self.project(x, cos[:s], sin[:s])
        o = attend(q, k, v, Masking(docs, self.variant()), self.state, self.context, self.ops, self._run)
        return self.finish(o, gate)

    def _run(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        if self.selective and torch.is_grad_enabled():
            # Selective recompute (Korthikanti et al. 2022): drop the s^2 attention internals.
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


class MLP(nn.Module):
    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, name: str, seed: int) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.state, self.ops = state, ops
        self.activation = mlp_activation(cfg)
        bias = has_mlp_bias(cfg)
        parts = [f, f] if self.activation.gated else [f]  # gated: gate and up fused in one column linear
        self.up = ColumnParallelLinear(h, parts, state, name=f"{name}.up", seed=seed, std=cfg.init_std,
                                       bias=bias, input_ready=True)
        self.down = RowParallelLinear(f, h, state, name=f"{name}.down", seed=seed,
                                      std=cfg.init_std / math.sqrt(2 * cfg.num_layers), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.ops, self.up(enter_tp_region(x, self.state))))


def mlp_activation(cfg: ModelSpec) -> MLPActivation:
    """The MLP activation model config `cfg` asks for (`model.mlp`, its clamp for clamped_swiglu)."""
    return MLPActivation(mlp_kind(cfg), cfg.swiglu_alpha, cfg.swiglu_limit)


@dataclass(frozen=True)
class BlockFeatures:
    """The optional parts a block is built with: a MoE feed-forward (`moe`), multi-head latent attention (`mla`)."""

    moe: MoEContext | None = None
    mla: MLAContext | None = None


class Block(nn.Module):
    """Built from its layer's spec (`pattern.layer_spec(cfg, index)`): the mixer, then the MLP (dense or MoE).
    With model.sandwich_norm (Gemma 2/3) each branch's output is normed too before its residual add. Nemotron-H's
    one-part layers (pattern.py) build one branch: a mamba or attention layer no MLP (`mlp`, `norm2` None), an mlp
    layer no mixer (`attn`, `norm1` None)."""

    def __init__(self, cfg: ModelSpec, state: ParallelState, ops: Ops, rng: RNGStreams, index: int, seed: int,
                 context: ContextOptions = ContextOptions(), features: BlockFeatures = BlockFeatures()) -> None:
        super().__init__()
        moe, mla = features.moe, features.mla
        name = f"layers.{index}"
        self.layer = layer_spec(cfg, index)  # the mixer kind
        spec = self.layer
        self.norm1 = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops) if spec.has_mixer else None
        self.attn: nn.Module | None  # the mixer, whatever its kind (one name: checkpoints and hooks find it the same way)
        if not spec.has_mixer:
            self.attn = None
        elif spec.mixer in LINEAR_MIXERS:  # Gated DeltaNet or Kimi Delta Attention (megalite/recurrent)
            self.attn = LinearMixer(cfg, state, ops, f"{name}.attn", seed, spec.mixer)
        elif spec.mixer == MAMBA:  # Mamba2 (megalite/recurrent/mamba2.py)
            self.attn = Mamba2Mixer(cfg, state, f"{name}.attn", seed)
        elif mla is None:
            self.attn = Attention(cfg, state, ops, f"{name}.attn", seed, context, self.layer)
        else:
            self.attn = MLAttention(cfg, mla, state, ops, f"{name}.attn", seed, context)  # megalite/mla
        self.norm2 = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops) if spec.has_mlp else None
        self.post_attn_norm: Norm | None = None
        self.post_mlp_norm: Norm | None = None
        if cfg.sandwich_norm:
            self.post_attn_norm = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops) if spec.has_mixer else None
            self.post_mlp_norm = Norm(cfg.hidden_size, cfg.arch, cfg.norm_eps, state, ops) if spec.has_mlp else None
        self.mlp: nn.Module | None = None
        if not spec.has_mlp:
            pass
        elif moe is not None and moe.settings.is_moe_layer(index):  # the FFN is a mixture of experts (megalite/moe)
            self.mlp = MoELayer(cfg, moe, state, ops, f"{name}.mlp", seed, MLP)
        else:
            self.mlp = MLP(cfg, state, ops, f"{name}.mlp", seed)
        self.dropout, self.rng, self.sp = cfg.dropout, rng, state.sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # On SP slices each TP rank holds different tokens: draw from the tp-local stream.
        return self.rng.dropout(x, self.dropout, self.training, tp_local=self.sp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> torch.Tensor:
        if self.attn is None or self.norm1 is None:  # an mlp layer (Nemotron-H's "-")
            return self.after_mixer(x, None)
        return self.after_mixer(x, self.attn(self.norm1(x), cos, sin, docs))

    def after_mixer(self, x: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
        """The block past its mixer, from the block input x and the mixer's output a (None: the layer has no mixer;
        the KV-cached decoder's entry too): [post-norm,] residual add, norm, MLP, [post-norm,] residual add."""
        if a is not None and self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        if self.mlp is None or self.norm2 is None:  # a mamba or attention layer (Nemotron-H's "M", "*")
            assert a is not None
            return x + self._drop(a)
        if a is None:
            h = self.norm2(x)
        else:
            # x = x + attention branch; h = norm2(x): fused into one pass (the sum is written once and read by
            # the norm in the same kernel) when the backend has the fused kernel.
            h, x = self.norm2.add_norm(self._drop(a), x)
        m = self.mlp(h)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + self._drop(m)
