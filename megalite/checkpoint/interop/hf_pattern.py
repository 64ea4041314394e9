"""What the Hugging Face families with a layer pattern (gpt-oss: hf_gpt_oss.py, Gemma 3: hf_gemma3.py) share: their
`layer_types` read into megalite's period and written back one per layer, the attention's tensor names, every
megalite tensor's global shape, and the check that a megalite model has the variant fields a family computes.

megalite's `model.layer_types` is transformers' vocabulary (megalite/model/pattern.py); a list shorter than the
model is a period repeated. The import keeps the shortest period that reproduces transformers' list (gpt-oss's
alternation is `["sliding_attention", "full_attention"]`, Gemma 3's 5 local : 1 global the six-entry period) and
`[]` when every layer is full; the export writes one entry per layer, as transformers' configs do.
"""

from __future__ import annotations

from typing import Any, Callable

from megalite.checkpoint.interop import hf
from megalite.errors import CheckpointError

FULL, SLIDING = "full_attention", "sliding_attention"


def read_layer_types(cfg: dict[str, Any], layers: int, default: list[str], name: str) -> dict[str, Any]:
    """`layer_types` (transformers' list, else `default`) and `sliding_window` as megalite model info: the shortest
    period, and the window only where some layer slides. A sliding layer with `sliding_window` null is a full one
    (transformers masks it causally)."""
    types = cfg.get("layer_types") or default
    window = cfg.get("sliding_window")
    if not (isinstance(types, list) and len(types) == layers and all(t in (FULL, SLIDING) for t in types)):
        raise CheckpointError(f"this {name} config cannot be imported: layer_types must list {FULL!r} or "
                              f"{SLIDING!r} for each of the {layers} layers, got {types!r}")
    if window is None:
        types = [FULL] * layers
    elif not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise CheckpointError(f"this {name} config cannot be imported: sliding_window={window!r} must be a positive "
                              "integer or null")
    if SLIDING not in types:
        return {}
    period = next(p for p in range(1, layers + 1) if all(types[i] == types[i % p] for i in range(layers)))
    return {"layer_types": types[:period], "sliding_window": window}


def layer_types(info: dict[str, Any]) -> list[str]:
    """megalite's `layer_types` (a period, maybe empty) as transformers' list, one entry per layer."""
    period = list(info.get("layer_types") or [FULL])
    return [period[i % len(period)] for i in range(info["num_layers"])]


def head_dim(info: dict[str, Any]) -> int:
    return int(info.get("head_dim") or info["hidden_size"] // info["num_heads"])


def attention_rules(i: int, info: dict[str, Any]) -> list[hf.Rule]:
    """Layer i's input norm, q/k/v/o (their biases with attn_bias), q/k norms (qk_norm) and sinks (attn_sinks),
    under transformers' names `model.layers.i.input_layernorm` / `self_attn.*`."""
    hd, ours, p = head_dim(info), f"layers.{i}.", f"model.layers.{i}."
    qkv = [info["num_heads"] * hd, info["num_kv_heads"] * hd, info["num_kv_heads"] * hd]
    out: list[hf.Rule] = [(ours + "norm1.weight", [p + "input_layernorm.weight"], None, False)]
    kinds = ["weight", "bias"] if info.get("attn_bias") else ["weight"]
    for kind in kinds:
        out += [(f"{ours}attn.qkv.{kind}", [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"], qkv, False),
                (f"{ours}attn.out.{kind}", [f"{p}self_attn.o_proj.{kind}"], None, False)]
    if info.get("qk_norm"):
        out += [(f"{ours}attn.{x}_norm.weight", [f"{p}self_attn.{x}_norm.weight"], None, False) for x in "qk"]
    if info.get("attn_sinks"):
        out.append((ours + "attn.sinks", [p + "self_attn.sinks"], None, False))
    return out


def ends(info: dict[str, Any]) -> tuple[list[hf.Rule], list[hf.Rule]]:
    """The rules before the layers (the embedding) and after them (final norm, the head unless tied)."""
    tail: list[hf.Rule] = [("final_norm.weight", ["model.norm.weight"], None, False)]
    if not info["tie_embeddings"]:
        tail.append(("head.weight", ["lm_head.weight"], None, False))
    return [("embedding.weight", ["model.embed_tokens.weight"], None, False)], tail


def shapes(info: dict[str, Any], rules: list[hf.Rule]) -> dict[str, tuple[int, ...]]:
    """The global shape (unpadded vocabulary) of every megalite tensor these rules name."""
    h, v, f, hd = info["hidden_size"], info["vocab_size"], info["ffn_hidden_size"], head_dim(info)
    q, kv, e = info["num_heads"] * hd, info["num_kv_heads"] * hd, info.get("moe_experts", 0)
    ef = info.get("moe_ffn_hidden_size") or f
    table = {"norm1.weight": (h,), "norm2.weight": (h,), "post_attn_norm.weight": (h,), "post_mlp_norm.weight": (h,),
             "attn.qkv.weight": (q + 2 * kv, h), "attn.qkv.bias": (q + 2 * kv,), "attn.out.weight": (h, q),
             "attn.out.bias": (h,), "attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,),
             "attn.sinks": (info["num_heads"],), "mlp.up.weight": (2 * f, h), "mlp.down.weight": (h, f),
             "mlp.router.weight": (e, h), "mlp.router.logit_bias": (e,), "mlp.experts.up": (e, 2 * ef, h),
             "mlp.experts.down": (e, h, ef), "mlp.experts.up_bias": (e, 2 * ef), "mlp.experts.down_bias": (e, h)}
    top = {"embedding.weight": (v, h), "final_norm.weight": (h,), "head.weight": (v, h)}
    return {name: top[name] if name in top else table[name.split(".", 2)[2]] for name, _, _, _ in rules}


# A check of one model info field: (the field, the phrase naming what the family needs, the test of its value).
Need = tuple[str, str, Callable[[Any], bool]]


def unmet(info: dict[str, Any], needs: list[Need]) -> list[str]:
    """The needs `info` does not meet, each as "<phrase> (has <value>)"."""
    # A field at the arch's own value is not recorded (megalite/model/pattern.py `variant_info`): show that value.
    own = {"mlp": "swiglu" if info.get("arch") == "llama" else "gelu"}
    return [f"{what} (has {field}={info.get(field, own.get(field))!r})" for field, what, ok in needs
            if not ok(info.get(field, own.get(field)))]


def off(value: Any) -> bool:
    """An optional field at its default: absent, false, zero or empty."""
    return not value or value == "none"
