"""What a Megatron-LM checkpoint's tensors must be, given its `args`: checked before anything is converted.

Megatron's args declare the dims (num_query_groups, ffn_hidden_size, hidden_size, ...); the tensors are the
truth. A field that contradicts them would have the converter regroup the QKV rows by the wrong group count, cut
an MLP at the wrong width, or write a checkpoint megalite cannot load; so every tensor's shape is compared with
the one the args give it, one line naming the field, its value and what the tensor holds. The same for a tied
head (`untie_embeddings_and_output_weights` false) whose saved `output_layer` differs from the embedding, and for
state the conversion would leave behind: optimizer state is refused unless --weights-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megalite.errors import CheckpointError


def layer_shapes(info: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """megalite per-layer name -> (one layer's shape in Megatron's layout, which args set it)."""
    h, nh, g, f = info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["ffn_hidden_size"]
    hd, gated = h // nh, info["arch"] == "llama"
    qkv = f"num_attention_heads={nh}, num_query_groups={g}, hidden_size={h}"
    fc1 = f"ffn_hidden_size={f}, hidden_size={h}" + (" (swiglu: gate and up)" if gated else "")
    out = {"norm1.weight": ((h,), f"hidden_size={h}"), "norm2.weight": ((h,), f"hidden_size={h}"),
           "attn.qkv.weight": (((nh + 2 * g) * hd, h), qkv), "attn.out.weight": ((h, nh * hd), f"hidden_size={h}"),
           "mlp.up.weight": (((2 if gated else 1) * f, h), fc1), "mlp.down.weight": ((h, f), f"ffn_hidden_size={f}")}
    if not gated:
        out.update({"norm1.bias": ((h,), f"hidden_size={h}"), "norm2.bias": ((h,), f"hidden_size={h}"),
                    "attn.qkv.bias": (((nh + 2 * g) * hd,), qkv), "attn.out.bias": ((h,), f"hidden_size={h}"),
                    "mlp.up.bias": ((f,), f"ffn_hidden_size={f}"), "mlp.down.bias": ((h,), f"hidden_size={h}")})
    return out


def top_shapes(info: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """megalite name of a tensor outside the layers -> (its shape, which args set it)."""
    h, v = info["hidden_size"], info["vocab_size"]
    return {"embedding.weight": ((v, h), f"hidden_size={h}"), "head.weight": ((v, h), f"hidden_size={h}, the "
                                                                            "embedding's vocab rows"),
            "final_norm.weight": ((h,), f"hidden_size={h}"), "final_norm.bias": ((h,), f"hidden_size={h}"),
            "position": ((info["seq_len"], h), f"hidden_size={h}")}


def check_shape(where: Path, tensor: str, have: tuple[int, ...], want: tuple[tuple[int, ...], str]) -> None:
    """One tensor against the shape the args give it (named by its Megatron key)."""
    if tuple(have) != tuple(want[0]):
        raise CheckpointError(f"{where}: {tensor} is {list(have)} but the checkpoint's args ({want[1]}) make it "
                              f"{list(want[0])}: the args contradict the tensors (or the layers differ in width); "
                              "the checkpoint is inconsistent, not converted")


def check_tied_head(where: Path, info: dict[str, Any], head: torch.Tensor | None, embedding: torch.Tensor) -> None:
    """A tied model's saved head copy (Megatron keeps one on the last stage) must be its embedding."""
    same = head is not None and head.shape == embedding.shape and torch.equal(head, embedding)
    if info["tie_embeddings"] and head is not None and not same:
        raise CheckpointError(f"{where}: args.untie_embeddings_and_output_weights is False (a tied head) but "
                              "output_layer.weight differs from the embedding: converting it as tied would drop the "
                              "head; the checkpoint's args are wrong (set it to True)")


def has_tensors(obj: Any) -> bool:
    """Whether a (nested) pickled state holds any tensor: Megatron's optimizer entry of a checkpoint that has
    optimizer state, as opposed to an empty one."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensors(v) for v in obj)
    return False


def refuse_optimizer_state(where: Path, what: str) -> None:
    raise CheckpointError(f"{where}: the checkpoint holds Megatron's optimizer state ({what}), which is not "
                          "converted: pass --weights-only to convert the model weights alone (the optimizer then "
                          "starts fresh)")


def leftover_tensors(where: Path, names: list[str], used: set[str], weights_only: bool) -> list[str]:
    """Refuse a tensor the conversion does not place (optimizer state: unless --weights-only); what is
    knowingly not carried."""
    left = sorted(n for n in names if n not in used and "_extra_state" not in n)
    model = [n for n in left if not n.startswith("optimizer.")]
    if model:
        raise CheckpointError(f"{where}: tensor {model[0]} has no place in megalite's model: refusing to drop it")
    if left and not weights_only:
        refuse_optimizer_state(where, left[0])
    return ["Megatron's optimizer state (--weights-only)"] if left else []
