"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 section 2.1; V3, arXiv 2412.19437), TP/SP/CP-aware.

Per token x [h] (docs/mla.md has the shapes at every step):
    c_q  = RMSNorm(q_a(x))                 [q_lora_rank]        (q_lora_rank = 0: q = q(x) directly)
    q    = q_b(c_q)                        [heads, nope + rope]  split into q_nope, q_pe; q_pe rotated
    c_kv, k_pe = kv_a(x)                   [kv_lora_rank], [rope]: one RoPE key shared by every head, rotated
    c_kv = RMSNorm(c_kv)                   the compressed KV cache is (c_kv, k_pe) per token and layer
    k_nope, v = kv_b(c_kv)                 [heads, nope], [heads, v_head_dim]
    k    = [k_nope, k_pe broadcast over heads]
    o    = softmax(q k^T * scale) v        scale = 1/sqrt(nope + rope) x YaRN's mscale(factor, mscale_all_dim)^2
    y    = out(o)                          [h]

Under tensor parallelism (Megatron-LM section 3, applied as Megatron-core's MLA does):
  - q_b (or q) and kv_b are column-parallel, split by heads: their outputs are per head, so each rank computes
    only its heads' q, k_nope and v, with no collective;
  - out is row-parallel over the heads' outputs: one all-reduce (reduce-scatter under SP) at the exit, as usual;
  - q_a and kv_a (and their RMSNorms) are replicated: every head on every rank needs the whole latent and the
    shared k_pe, and they are small (hidden x (q_lora + kv_lora + rope)). Each rank computes them on its input
    (made whole by the block's f / SP all-gather) and back-propagates only its heads' share of the gradient, so
    their weight gradients are partial sums over TP: declared `sp_partial` (like Qwen3's q/k norms, all-reduced
    over TP by the gradient sync), and the input gradient is summed by f's backward with the column layers'.
  They stay in the run dtype under FP8 (`fp8.recipe`): their per-rank gradients are partial sums, whose FP8 scales
  would differ from one process's; q_b, kv_b and out are the existing parallel linears and get FP8 as any other.

The attention core takes q/k/v of one head width: v (v_head_dim) is zero-padded to the q/k width (or q and k to
v's when v is wider) and the output sliced back, so every path (SDPA, the Triton flash kernel, every cp mode and
document masking) runs unchanged; the zero columns add no score and only the sliced-off output columns. The
softmax scale correction and 1/sqrt(width) of the padded width are folded into q (the kernels scale by
1/sqrt(q's width)).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.context.attend import Local, Masking, context_attention
from megalite.context.options import ContextOptions
from megalite.context.blockwise import Backend
from megalite.context.documents import DocumentIds, document_causal_mask
from megalite.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, enter_tp_region
from megalite.mla.config import MLAConfig
from megalite.parallel.param_spec import REPLICATED, ParamSpec
from megalite.parallel.state import ParallelState

Tensor = torch.Tensor
Rope = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
MaskedAttention = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
FLASH_MAX_HEAD_DIM = 128  # the widest head the Triton flash kernel is tested at; wider heads run SDPA
log = logging.getLogger(__name__)


class MLAOps(Protocol):
    """What MLA calls of the model's op backend (`megalite.model.ops.Ops` satisfies it)."""

    @property
    def rms_norm(self) -> Callable[[Tensor, Tensor, float], Tensor]: ...
    @property
    def apply_rope(self) -> Rope: ...
    @property
    def attention(self) -> Callable[..., Tensor]: ...
    @property
    def block_backend(self) -> Backend: ...
    @property
    def document_attention(self) -> Optional[Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]]: ...


class MLAModel(Protocol):
    """What MLA reads of the model config (`megalite.model.spec.ModelSpec` satisfies it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def init_std(self) -> float: ...
    @property
    def recompute(self) -> str: ...


@dataclass(frozen=True)
class MLAContext:
    """What a block needs to build MLA, from the model: the section, YaRN's softmax-scale factor, and the torch
    ops (per-document RoPE positions and heads too wide for the flash kernel run them) with masked attention."""

    config: MLAConfig
    softmax_factor: float
    torch_ops: MLAOps
    masked: MaskedAttention


class LatentNorm(nn.Module):
    """RMSNorm of a latent (q_a / kv_a output): replicated, its gradient a partial sum over TP."""

    def __init__(self, dim: int, eps: float, state: ParallelState, ops: MLAOps) -> None:
        super().__init__()
        self.eps, self.ops, self.partial = eps, ops, state.tp > 1
        self.weight = nn.Parameter(torch.ones(dim))

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec(REPLICATED, sp_partial=self.partial)}

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight.to(x.dtype), self.eps)


class MLAttention(nn.Module):
    """The block's attention when `mla.kv_lora_rank > 0`: forward(x, cos, sin, docs) as `model.block.Attention`,
    cos/sin of width qk_rope_head_dim / 2. Parameter names: q_a, q_a_norm, q_b (or q), kv_a, kv_a_norm, kv_b,
    out (transformers' q_a_proj, q_a_layernorm, q_b_proj / q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj: megalite/checkpoint/interop/hf_mla.py)."""

    def __init__(self, cfg: MLAModel, mla: MLAContext, state: ParallelState, ops: MLAOps, name: str, seed: int,
                 context: ContextOptions = ContextOptions()) -> None:
        super().__init__()
        c = mla.config
        h, nh = cfg.hidden_size, cfg.num_heads
        if nh % state.tp:
            raise ValueError(f"num_heads={nh} must be divisible by tp={state.tp}")
        self.state, self.context, self.mla = state, context, mla
        self.nope, self.rope_dim, self.v_dim, self.kv_rank = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                                              c.kv_lora_rank)
        self.qk_dim = self.nope + self.rope_dim
        self.width = max(self.qk_dim, self.v_dim)  # the attention core's head width (the narrower side padded)
        # The core scales by 1/sqrt(width): fold 1/sqrt(qk_dim) x YaRN's factor into q instead.
        self.q_scale = mla.softmax_factor * math.sqrt(self.width / self.qk_dim)
        self.local_heads = nh // state.tp
        self.selective = cfg.recompute == "selective"
        self.ops = ops
        if self.width > FLASH_MAX_HEAD_DIM and ops.block_backend == "triton":
            _log_torch_core(self.width)
            self.ops = mla.torch_ops
        std = cfg.init_std
        self.q_a: ReplicatedLinear | None = None
        self.q_a_norm: LatentNorm | None = None
        if c.q_lora_rank:
            self.q_a = ReplicatedLinear(h, c.q_lora_rank, state, name=f"{name}.q_a", seed=seed, std=std)
            self.q_a_norm = LatentNorm(c.q_lora_rank, cfg.norm_eps, state, ops)
        # q_lora_rank > 0: q_b up-projects the latent; 0: q projects x directly (HF's q_proj). One of them is set.
        self.q_b: ColumnParallelLinear | None = None
        self.q: ColumnParallelLinear | None = None
        if c.q_lora_rank:
            self.q_b = ColumnParallelLinear(c.q_lora_rank, [nh * self.qk_dim], state, name=f"{name}.q_b", seed=seed,
                                            std=std, input_ready=True)
        else:
            self.q = ColumnParallelLinear(h, [nh * self.qk_dim], state, name=f"{name}.q", seed=seed, std=std,
                                          input_ready=True)
        self.kv_a = ReplicatedLinear(h, c.kv_lora_rank + self.rope_dim, state, name=f"{name}.kv_a", seed=seed,
                                     std=std)
        self.kv_a_norm = LatentNorm(c.kv_lora_rank, cfg.norm_eps, state, ops)
        self.kv_b = ColumnParallelLinear(c.kv_lora_rank, [nh * (self.nope + self.v_dim)], state, name=f"{name}.kv_b",
                                         seed=seed, std=std, input_ready=True)
        # Scaled init of residual-branch outputs (GPT-2 / Megatron): std / sqrt(2 * num_layers).
        self.out = RowParallelLinear(nh * self.v_dim, h, state, name=f"{name}.out", seed=seed,
                                     std=std / math.sqrt(2 * cfg.num_layers))

    def compress(self, x: Tensor, cos: Tensor, sin: Tensor, rope: Rope | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """(q [b, s, heads, qk] rotated and scaled, c_kv [b, s, kv_lora_rank] normed, k_pe [b, s, 1, rope]
        rotated) from x made whole over TP: (c_kv, k_pe) is what a KV cache keeps per token."""
        b, s, _ = x.shape
        if self.q_a is not None and self.q_a_norm is not None and self.q_b is not None:
            (q,) = self.q_b(self.q_a_norm(self.q_a(x)))
        else:
            assert self.q is not None
            (q,) = self.q(x)
        q = q.view(b, s, self.local_heads, self.qk_dim)
        c_kv, k_pe = self.kv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe, k_pe = (rope or self.ops.apply_rope)(q_pe.contiguous(), k_pe.reshape(b, s, 1, self.rope_dim), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return q * self.q_scale if self.q_scale != 1.0 else q, self.kv_a_norm(c_kv.contiguous()), k_pe

    def expand(self, c_kv: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [b, t, heads, width] of this rank's heads from the compressed (c_kv, k_pe), v zero-padded."""
        b, t, _ = c_kv.shape
        (kv,) = self.kv_b(c_kv)
        k_nope, v = kv.view(b, t, self.local_heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, t, self.local_heads, self.rope_dim)], dim=-1)
        return _pad(k, self.width), _pad(v, self.width)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: DocumentIds | None = None) -> Tensor:
        x = enter_tp_region(x, self.state)
        b, s, _ = x.shape
        if docs is None:
            q, c_kv, k_pe = self.compress(x, cos[:s], sin[:s])
        else:  # per-document positions: cos/sin [b, s, rope/2], which only the torch RoPE takes
            q, c_kv, k_pe = self.compress(x, cos, sin, rope=self.mla.torch_ops.apply_rope)
        k, v = self.expand(c_kv, k_pe)
        o = self._attend(_pad(q, self.width), k, v, docs)[..., :self.v_dim]
        return self.out(o.reshape(b, s, self.local_heads * self.v_dim))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, docs: DocumentIds | None) -> Tensor:
        """As `model.block.Attention.forward`'s core: whole sequences, document masking, or the cp modes."""
        if docs is not None:
            if self.state.cp > 1:
                return context_attention(q, k, v, self.state, self.context, Local(self._core, "torch"), Masking(docs))
            if self.ops.document_attention is not None:
                return self._run(self.ops.document_attention, q, k, v, docs.local)
            return self._core(q, k, v, document_causal_mask(docs.local, docs.local))
        if self.state.cp > 1:
            return context_attention(q, k, v, self.state, self.context, Local(self._core, self.ops.block_backend))
        return self._core(q, k, v)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
        if keep is None:
            return self._run(self.ops.attention, q, k, v)
        return self._run(self.mla.masked, q, k, v, keep)

    def _run(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        if self.selective and torch.is_grad_enabled():
            # Selective recompute (Korthikanti et al. 2022): drop the s^2 attention internals.
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


@functools.cache
def _log_torch_core(width: int) -> None:
    """Said once per process (not once per layer)."""
    log.warning("MLA: attention head width %d exceeds the Triton flash kernel's %d: the attention core runs torch "
                "SDPA", width, FLASH_MAX_HEAD_DIM)


def _pad(t: Tensor, width: int) -> Tensor:
    """t with its last dim zero-padded to `width` (itself when already that wide)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
