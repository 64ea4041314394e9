"""One MLA attention's weights between megalite (megalite/mla/attention.py) and transformers' DeepseekV3Attention.

| megalite (`layers.{i}.attn.`) | transformers (`model.layers.{i}.self_attn.`) | shape [out, in]                         |
|---|---|---|
| q_a.weight                    | q_a_proj.weight                              | [q_lora_rank, hidden]                    |
| q_a_norm.weight               | q_a_layernorm.weight                         | [q_lora_rank]                            |
| q_b.weight                    | q_b_proj.weight                              | [heads x (nope + rope), q_lora_rank]     |
| q.weight (q_lora_rank = 0)    | q_proj.weight                                | [heads x (nope + rope), hidden]          |
| kv_a.weight                   | kv_a_proj_with_mqa.weight                    | [kv_lora_rank + rope, hidden]            |
| kv_a_norm.weight              | kv_a_layernorm.weight                        | [kv_lora_rank]                           |
| kv_b.weight                   | kv_b_proj.weight                             | [heads x (nope + v), kv_lora_rank]       |
| out.weight                    | o_proj.weight                                | [hidden, heads x v]                      |

Same tensors, same row order, with one exception: DeepSeek's checkpoints (`rope_interleave`, transformers'
default for DeepseekV3) rotate the RoPE dims as interleaved pairs (x0, x1), (x2, x3), ..., megalite as halves
(rotate-half, as Llama). Rotating interleaved pairs equals rotating halves of the de-interleaved vector
[x0, x2, ..., x1, x3, ...], and transformers returns it in that order: so permuting the rows that produce the
RoPE part (each head's last `rope` rows of q_b / q, kv_a's last `rope` rows) gives the same q and k, in the same
order, as transformers' computes. Export applies the inverse permutation.

For a whole-model import: transformers builds `q_a_layernorm` and `kv_a_layernorm` with eps 1e-6 whatever
`rms_norm_eps` says, megalite with `model.norm_eps` (DeepSeek-V3's rms_norm_eps is 1e-6: the same), and its
dense layers' MLP is Llama's (tests/test_mla.py's dense DeepseekV3 logits test maps one).
"""

from __future__ import annotations

import torch

from megalite.mla.config import MLAConfig

HF_NAMES = {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj", "q": "q_proj",
            "kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj", "out": "o_proj"}


def _deinterleave(n: int) -> torch.Tensor:
    """[0, 2, 4, ..., 1, 3, 5, ...] of n (even)."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _permute_rope_rows(w: torch.Tensor, groups: int, group_rows: int, rope: int, order: torch.Tensor) -> torch.Tensor:
    """w with the last `rope` rows of each of its `groups` blocks of `group_rows` rows reordered by `order`."""
    blocks = w.reshape(groups, group_rows, *w.shape[1:]).clone()
    blocks[:, group_rows - rope:] = blocks[:, group_rows - rope:][:, order]
    return blocks.reshape(w.shape)


def _rope_rows(name: str, mla: MLAConfig, heads: int) -> tuple[int, int] | None:
    """(groups, rows per group) of a weight whose rows end each group with RoPE rows, else None."""
    if name in ("q_b", "q"):
        return heads, mla.qk_head_dim
    if name == "kv_a":
        return 1, mla.kv_lora_rank + mla.qk_rope_head_dim
    return None


def _convert(tensors: dict[str, torch.Tensor], mla: MLAConfig, heads: int, interleaved: bool, to_hf: bool
             ) -> dict[str, torch.Tensor]:
    order = _deinterleave(mla.qk_rope_head_dim)
    if to_hf:
        order = torch.argsort(order)  # the inverse permutation
    out = {}
    for ours, theirs in HF_NAMES.items():
        src, dst = (ours, theirs) if to_hf else (theirs, ours)
        if f"{src}.weight" not in tensors:
            continue
        w = tensors[f"{src}.weight"]
        rows = _rope_rows(ours, mla, heads)
        if interleaved and rows is not None:
            w = _permute_rope_rows(w, rows[0], rows[1], mla.qk_rope_head_dim, order)
        out[f"{dst}.weight"] = w
    return out


def attention_from_hf(tensors: dict[str, torch.Tensor], mla: MLAConfig, heads: int, interleaved: bool
                      ) -> dict[str, torch.Tensor]:
    """megalite's attention tensors (names relative to `attn.`) from one DeepseekV3Attention's state dict."""
    return _convert(tensors, mla, heads, interleaved, to_hf=False)


def attention_to_hf(tensors: dict[str, torch.Tensor], mla: MLAConfig, heads: int, interleaved: bool
                    ) -> dict[str, torch.Tensor]:
    """One DeepseekV3Attention's state dict from megalite's attention tensors (the inverse of `attention_from_hf`)."""
    return _convert(tensors, mla, heads, interleaved, to_hf=True)
