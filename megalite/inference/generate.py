"""Autoregressive text generation from a single-process GPT: KV cache, greedy / temperature / top-k / top-p.

A step of plain decoding recomputes the whole prefix (O(n^2) work for n tokens). With the KV cache each
layer keeps the keys and values of every position already seen, so a step runs the new token only and
attends to the cached keys: the same numbers (the test holds the generated tokens equal token for token,
and the logits to fp32 round-off), O(n) work. The cached forward below reuses the model's own modules
(norms, qkv/out projections, MLP, head) and differs from `GPT.forward` only in the attention: queries at
positions [start, start+s) attend to the cached keys [0, start) plus the new ones, causally, and RoPE /
learned positions are taken at the absolute positions. It also runs tensor-parallel (every rank of a tp
group calls it; without sequence parallelism, whose sequence slices a one-token step cannot have): the
model's own linears do the collectives, each rank caches its own kv heads, and the vocabulary slices of
the logits are gathered.

Sampling (Holtzman et al. 2020 for top-p): `temperature == 0` is greedy (argmax); otherwise logits are
divided by the temperature, cut to the `top_k` largest and to the smallest set whose probability reaches
`top_p`, and sampled from a generator seeded with `seed` (same seed, same text on the same device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megalite.attention.variant import reference_attention
from megalite.mla.attention import MLAttention
from megalite.model.gpt import GPT
from megalite.model.linear_mixer import LinearMixer
from megalite.model.mamba_mixer import Mamba2Mixer
from megalite.recurrent.gated_deltanet import RecurrentCache
from megalite.parallel import comm


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no cut
    top_p: float = 1.0  # 1 = no cut
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # stop after emitting one of these (e.g. the tokenizer's EOD)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling settings {self}: need max_new_tokens >= 0, temperature >= 0, "
                             "top_k >= 0, 0 < top_p <= 1")


class KVCache:
    """Per layer: keys and values [B, S_max, Hkv, D] preallocated for the model's seq_len. A sliding-window layer
    (model.layer_types, window W) keeps only the last W - 1 positions' (all the next query can see besides its
    own): [B, <= W - 1, Hkv, D], replaced each step. With multi-head latent attention (megalite/mla) the compressed
    cache instead: `k` holds the latent c_kv [B, S_max, kv_lora_rank] and `v` the RoPE key shared by the heads
    k_pe [B, S_max, 1, qk_rope_head_dim] (DeepSeek-V2 section 2.1). A linear_attention layer (Gated DeltaNet) keeps
    its `RecurrentCache` in `recurrent` instead: the conv's last W - 1 inputs and the state [B, H, K, V], constant
    in size (None before the prompt)."""

    def __init__(self, model: GPT, batch: int, dtype: torch.dtype) -> None:
        device, s = _device(model), model.cfg.seq_len
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.recurrent: dict[str, RecurrentCache | None] = {}
        for name, block in model.layers.items():
            attn: Any = block.attn
            if isinstance(attn, (LinearMixer, Mamba2Mixer)):
                self.recurrent[name] = None
                continue
            if attn is None:  # an mlp layer (no mixer, no cache)
                continue
            k_shape: tuple[int, ...]
            v_shape: tuple[int, ...]
            if isinstance(attn, MLAttention):
                k_shape, v_shape = (batch, s, attn.kv_rank), (batch, s, 1, attn.rope_dim)
            else:
                k_shape = v_shape = (batch, 0 if attn.window is not None else s, attn.local_kv, attn.head_dim)
            self.k[name] = torch.zeros(k_shape, dtype=dtype, device=device)
            self.v[name] = torch.zeros(v_shape, dtype=dtype, device=device)
        self.length = 0


def _device(model: GPT) -> torch.device:
    return next(model.parameters()).device


def _cached_attention(attn: Any, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                      name: str) -> torch.Tensor:
    b, s, _ = x.shape
    start, (cos, sin) = cache.length, tables
    q, k, v, gate = attn.project(x, cos[start:start + s], sin[start:start + s])
    variant = attn.variant()
    if attn.window is not None:  # the last W - 1 positions before `start`, then the new ones
        keys, values = torch.cat([cache.k[name], k], dim=1), torch.cat([cache.v[name], v], dim=1)
        keep = max(attn.window - 1, 0)
        cache.k[name], cache.v[name] = keys[:, keys.shape[1] - keep:], values[:, values.shape[1] - keep:]
    else:
        cache.k[name][:, start:start + s] = k
        cache.v[name][:, start:start + s] = v
        keys, values = cache.k[name][:, :start + s], cache.v[name][:, :start + s]
    if variant.is_plain:
        # New query i (absolute position start+i) sees keys 0..start+i.
        mask = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(diagonal=start)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=attn.local_heads != attn.local_kv)
        return attn.finish(o.transpose(1, 2), gate)
    # The variant's own math (window, sinks, soft-cap, scale) at the absolute positions of queries and keys.
    key_pos = torch.arange(start + s - keys.shape[1], start + s, device=x.device)
    o = reference_attention(q, keys, values, variant, torch.arange(start, start + s, device=x.device), key_pos)
    return attn.finish(o, gate)


def _cached_latent_attention(attn: MLAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             c_cache: torch.Tensor, pe_cache: torch.Tensor, start: int) -> torch.Tensor:
    """MLA from the compressed cache, with W_UK absorbed into the query and W_UV applied after the weighted sum
    (DeepSeek-V2 section 2.1.3): scores = (q_nope W_UK) . c_kv + q_pe . k_pe, never expanding the cached
    tokens' keys and values. `compress` gives q already multiplied by the scale correction (`MLAttention.q_scale`)
    that the attention core's 1/sqrt(width) completes."""
    b, s, _ = x.shape
    q, c_kv, k_pe = attn.compress(x, cos[start:start + s], sin[start:start + s])
    c_cache[:, start:start + s] = c_kv
    pe_cache[:, start:start + s] = k_pe
    c, pe = c_cache[:, :start + s], pe_cache[:, :start + s, 0]
    w = attn.kv_b.weight.view(attn.local_heads, attn.nope + attn.v_dim, attn.kv_rank)
    q_latent = torch.einsum("bshn,hnr->bshr", q[..., :attn.nope], w[:, :attn.nope].to(q.dtype))
    scores = (torch.einsum("bshr,btr->bsht", q_latent, c)
              + torch.einsum("bshp,btp->bsht", q[..., attn.nope:], pe)) / math.sqrt(attn.width)
    # New query i (absolute position start+i) sees keys 0..start+i.
    mask = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(diagonal=start)
    p = scores.float().masked_fill(~mask[None, :, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
    o = torch.einsum("bshr,hvr->bshv", torch.einsum("bsht,btr->bshr", p, c), w[:, attn.nope:].to(q.dtype))
    return attn.out(o.reshape(b, s, attn.local_heads * attn.v_dim))


@torch.no_grad()
def forward_cached(model: GPT, ids: torch.Tensor, cache: KVCache, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [B, s, vocab_size] of `ids` [B, s], the tokens at positions [cache.length, cache.length + s)."""
    start, s = cache.length, ids.shape[1]
    if start + s > model.cfg.seq_len:
        raise ValueError(f"{start + s} positions exceed the model's seq_len={model.cfg.seq_len}")
    assert model.embedding is not None and model.final_norm is not None and model.head is not None
    x = model.scale_embedding(model.embedding(ids))
    if model.position is not None:
        x = x + model.position[start:start + s].to(x.dtype)
    x = x.to(dtype)
    for name, module in model.layers.items():
        block: Any = module
        if block.attn is None:
            a = None
        elif isinstance(block.attn, (LinearMixer, Mamba2Mixer)):
            a, cache.recurrent[name] = block.attn.cached(block.norm1(x), cache.recurrent[name])
        elif isinstance(block.attn, MLAttention):
            cos, sin = model.rope_of(name)
            a = _cached_latent_attention(block.attn, block.norm1(x), cos, sin, cache.k[name], cache.v[name], start)
        else:
            a = _cached_attention(block.attn, block.norm1(x), model.rope_of(name), cache, name)
        x = block.after_mixer(x, a)
    cache.length = start + s
    logits = model.logits(model.final_norm(x))
    # Under tensor parallelism (no SP) each rank holds a vocabulary slice: gather them, so every rank of
    # the group picks the same token from the same logits (a no-op at tp=1).
    logits = comm.all_gather(logits, model.state, "tp", dim=-1)
    return logits[..., :model.cfg.vocab_size].float()


@torch.no_grad()
def full_logits(model: GPT, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of the last position by the model's ordinary forward over the whole prefix (no cache)."""
    return model(ids, dtype=dtype)[:, -1, :model.cfg.vocab_size].float()


def pick(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= cfg.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate_ids(model: GPT, prompt: Sequence[int], cfg: SamplingConfig, use_cache: bool = True,
                 dtype: torch.dtype = torch.float32) -> Iterator[int]:
    """Yield new token ids one at a time (stops at a stop id, after max_new_tokens, or at seq_len)."""
    was_training = model.training
    model.eval()
    device = _device(model)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    budget = min(cfg.max_new_tokens, model.cfg.seq_len - ids.shape[1])
    cache = KVCache(model, 1, dtype) if use_cache else None
    try:
        step_input = ids
        for _ in range(max(0, budget)):
            if cache is not None:
                logits = forward_cached(model, step_input, cache, dtype)[:, -1]
            else:
                logits = full_logits(model, ids, dtype)
            token = pick(logits, cfg, generator)
            ids = torch.cat([ids, token[:, None]], dim=1)
            step_input = token[:, None]
            yield int(token.item())
            if int(token.item()) in cfg.stop_ids:
                return
    finally:
        model.train(was_training)


class TextStream:
    """Turns a growing list of ids into text pieces to print: each piece is the newly decoded suffix,
    held back while the text ends in U+FFFD (a UTF-8 character split across byte tokens)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def flush(self) -> str:
        text = self.decode(self.ids)
        piece = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return piece
