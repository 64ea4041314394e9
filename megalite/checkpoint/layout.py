"""Where a rank's local TP shard sits inside each global (logical) tensor, without any process group.

A sharded checkpoint stores every logical tensor in its *global, unpadded* shape (the layout-free
truth) as a set of slabs; a rank at any layout then asks "which global regions make up my local
shard?" and reads just those. This file answers that question from the parameter's `TPLayout` (its
`ParamSpec`, declared by `megalite.layers`), the tp degree and rank, and the real vocabulary size:

  replicated        the local tensor is the whole global tensor
  row               dim 1 split: rank r holds columns [r*n, (r+1)*n)
  column(parts)     dim 0 is the concatenation of logical parts (q, k, v / gate, up), each split
                    separately, so rank r holds one row block *per part*: several pieces
  vocab             dim 0 split of the PADDED vocabulary (Megatron pads it to a multiple of
                    tp * make_vocab_divisible_by): rank r holds padded rows [r*n, (r+1)*n), of which
                    only those below vocab_size are real; the rest are padding, not stored. The
                    output head is a single-part column linear over the padded vocabulary, i.e. the
                    same thing, so `embedding.weight` and `head.weight` are both treated as vocab.

The same rules give the layout of a tensor from its name alone (`layout_for`), which the offline
reshard tool needs to plan a target layout without building a model.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any

from megalite.errors import CheckpointError
from megalite.layers.embedding import padded_vocab_size
from megalite.mla.config import MLAConfig
from megalite.model.pattern import gate_width, gated_mlp, variant_info
from megalite.model.spec import ModelSpec
from megalite.moe.config import MoEConfig
from megalite.parallel.param_spec import REPLICATED, ROW, VOCAB, TPLayout, column, logical_name

VOCAB_TENSORS = ("embedding.weight", "head.weight")
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Piece:
    """A rectangular region: `shape` elements starting at `local` in the shard and `glob` in the tensor."""

    local: tuple[int, ...]
    glob: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardMap:
    """How one local shard maps into its global tensor; local elements outside every piece are padding."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def layout_of(name: str, tp_layout: TPLayout) -> TPLayout:
    """The effective layout: the head's single-part column split over the padded vocab is a vocab split."""
    if logical_name(name) in VOCAB_TENSORS and tp_layout.split:
        return VOCAB
    return tp_layout


def shard_map(name: str, local_shape: tuple[int, ...], tp_layout: TPLayout, tp: int, tp_rank: int,
              vocab_size: int) -> ShardMap:
    """The pieces of global tensor `name` that rank `tp_rank` of `tp` holds in a shard of `local_shape`."""
    local_shape = tuple(local_shape)
    layout = layout_of(name, tp_layout)
    zeros = (0,) * len(local_shape)
    if not layout.split or (tp == 1 and layout.kind != "vocab"):
        return ShardMap(local_shape, local_shape, (Piece(zeros, zeros, local_shape),))
    kind, rest = layout.kind, local_shape[1:]
    if kind == "row":
        n = local_shape[1]
        glob = (local_shape[0], n * tp) + local_shape[2:]
        start = (0, tp_rank * n) + (0,) * (len(local_shape) - 2)
        return ShardMap(glob, local_shape, (Piece(zeros, start, local_shape),))
    if kind == "vocab":
        rows = local_shape[0]
        first = tp_rank * rows
        real = max(0, min(rows, vocab_size - first))
        pieces = (Piece(zeros, (first,) + (0,) * len(rest), (real,) + rest),) if real else ()
        return ShardMap((vocab_size,) + rest, local_shape, pieces)
    if kind == "column":
        parts = list(layout.parts)
        pieces_l: list[Piece] = []
        lo = go = 0
        for p in parts:
            n = p // tp
            pieces_l.append(Piece((lo,) + (0,) * len(rest), (go + tp_rank * n,) + (0,) * len(rest), (n,) + rest))
            lo, go = lo + n, go + p
        if lo != local_shape[0]:
            raise CheckpointError(f"{name}: local rows {local_shape[0]} do not match its column parts {parts} / "
                                  f"tp={tp}; the model and its TP layout disagree (a megalite bug, please report)")
        return ShardMap((go,) + rest, local_shape, tuple(pieces_l))
    raise CheckpointError(f"{name}: unknown TP layout {layout!r} (a megalite bug, please report)")


# ----------------------------------------------------------------------------- planning without a model
def model_info(cfg: ModelSpec | Any, mla: MLAConfig | None = None) -> dict[str, Any]:
    """The model dimensions a checkpoint records (and checks on load), from a model spec (`ModelArgs`; `Any`: a GPT
    chunk's `cfg`) and, for multi-head latent attention, its `[mla]` section (recorded as `mla`, only when on)."""
    keys = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
            "seq_len", "make_vocab_divisible_by", "tie_embeddings", "norm_eps", "rope_theta")
    info = {k: getattr(cfg, k) for k in keys}
    # A MoE model's routing and a q/k-normed attention change the computation too; recorded only when on,
    # so a dense model's index.json is as before.
    if cfg.moe.experts:
        info.update({f"moe_{f.name}": getattr(cfg.moe, f.name) for f in fields(MoEConfig)})
    if cfg.qk_norm:
        info["qk_norm"] = True
    if cfg.head_dim:
        info["head_dim"] = cfg.head_dim
    if cfg.rope_scaling != "none":  # YaRN / llama3 (megalite/model/rope.py): all its fields
        info.update({k: getattr(cfg, k) for k in ROPE_INFO_KEYS})
    if mla is not None and mla.enabled:
        info["mla"] = dataclasses.asdict(mla)
    info.update(variant_info(cfg))  # the layer pattern and the attention / MLP variants, where not the defaults
    return info


# The `[moe]` fields a checkpoint records for a MoE model (docs/moe.md), flat in index.json's "model" as
# "moe_" + field: the names they had as model.moe_* fields, so checkpoints of every megalite version read alike.
MOE_INFO_KEYS = tuple(f"moe_{f.name}" for f in fields(MoEConfig))


def moe_from_info(info: dict[str, Any]) -> MoEConfig:
    """The `[moe]` section a checkpoint's model info records (the defaults, i.e. dense, for a dense model)."""
    return MoEConfig(**{k.removeprefix("moe_"): info[k] for k in MOE_INFO_KEYS if k in info})


ROPE_INFO_KEYS = ("rope_scaling", "rope_factor", "rope_original_max_positions", "rope_beta_fast", "rope_beta_slow",
                  "rope_mscale", "rope_mscale_all_dim", "rope_low_freq_factor", "rope_high_freq_factor")


def layout_for(name: str, info: dict[str, Any]) -> TPLayout:
    """The TP layout a parameter of this name has in a megalite GPT (tested against the real model)."""
    name = logical_name(name)
    if name in VOCAB_TENSORS:
        return VOCAB
    hd = info.get("head_dim") or info["hidden_size"] // info["num_heads"]
    f = info["ffn_hidden_size"]
    nh, gate = info["num_heads"], gate_width(info["num_heads"], hd, info.get("attn_output_gate", "none"))
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):  # the output gate: a 4th part
        return column((nh * hd, info["num_kv_heads"] * hd, info["num_kv_heads"] * hd) + ((gate,) if gate else ()))
    if name.endswith("attn.sinks"):  # split with the query heads
        return column((nh,))
    if name.endswith("mlp.up.weight") or name.endswith("mlp.up.bias"):
        return column((f, f) if gated_mlp(info["arch"], info.get("mlp", "auto")) else (f,))
    if name.endswith("attn.out.weight") or name.endswith("mlp.down.weight"):
        return ROW
    mla = info.get("mla")
    if mla and (name.endswith("attn.q_b.weight") or name.endswith("attn.q.weight")):  # MLA (megalite/mla): by heads
        return column((info["num_heads"] * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]),))
    if mla and name.endswith("attn.kv_b.weight"):
        return column((info["num_heads"] * (mla["qk_nope_head_dim"] + mla["v_head_dim"]),))
    return REPLICATED  # MLA's q_a, kv_a and their norms too


def local_shape_for(name: str, global_shape: tuple[int, ...], tp_layout: TPLayout, tp: int,
                    info: dict[str, Any]) -> tuple[int, ...]:
    """The shape of one TP shard of a global tensor at `tp` (vocab rows padded as the model pads them)."""
    g = tuple(global_shape)
    layout = layout_of(name, tp_layout)
    if not layout.split:
        return g
    if layout.kind == "row":
        return (g[0], g[1] // tp) + g[2:]
    if layout.kind == "vocab":
        return (padded_vocab_size(info["vocab_size"], tp, info.get("make_vocab_divisible_by", 1)) // tp,) + g[1:]
    return (g[0] // tp,) + g[1:]


def stage_of(name: str, num_layers: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None) -> int:
    """The pipeline rank that holds parameter `name` (embedding first, final norm/head last)."""
    from megalite.pipeline.partition import virtual_stage_layers

    name = logical_name(name)
    ranges = virtual_stage_layers(num_layers, pp, vpp, pp_layers)
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        virtual = next(i for i, r in enumerate(ranges) if layer in r)
    elif name.startswith("embedding.") or name == "position":
        virtual = 0
    else:
        virtual = len(ranges) - 1
    return virtual % pp
