"""How many parameters megalite's GPT has, from its dimensions alone (no torch): config validation checks
a model fits before building it, and the cost model (megalite/perfmodel) sizes memory and FLOPs from it.
tests/test_flops_estimate.py holds it equal to a built model's count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamShape:
    """The dimensions the parameter count depends on (resolved: no "derive me" zeros)."""

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tie: bool
    head_dim: int | None = None  # None: hidden / num_heads


def count_params(shape: ParamShape) -> int:
    """Parameters of megalite's GPT (unpadded vocabulary, no parallelism).

    llama, per layer: q and o h x h each, k and v h x (kv·head_dim) each; SwiGLU 3·h·ffn;
    two RMSNorm weights. Then a final RMSNorm, the V x h embedding and an untied head unless `tie`.
    gpt2 adds biases (qkv, out, both MLP linears), LayerNorm weight+bias, a 2·h·ffn GeLU MLP
    and learned positions (s x h); its head is normally tied. `head_dim` defaults to hidden/heads.
    """
    arch, num_layers, hidden, ffn, vocab = shape.arch, shape.num_layers, shape.hidden, shape.ffn, shape.vocab
    num_heads, num_kv_heads, seq_len, tie, head_dim = (shape.num_heads, shape.num_kv_heads, shape.seq_len, shape.tie,
                                                       shape.head_dim)
    hd = hidden // num_heads if head_dim is None else head_dim
    q, kv = num_heads * hd, num_kv_heads * hd
    attn = hidden * (q + 2 * kv) + q * hidden
    if arch == "llama":
        layer = attn + 3 * hidden * ffn + 2 * hidden
        outside = hidden + vocab * hidden
    else:
        layer = attn + (q + 2 * kv) + hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
        outside = 2 * hidden + vocab * hidden + seq_len * hidden
    return num_layers * layer + outside + (0 if tie else vocab * hidden)
