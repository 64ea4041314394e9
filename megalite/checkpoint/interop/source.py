"""A checkpoint of any format seen as megalite's logical tensors, and the writer of a megalite checkpoint from it.

Every reader (megalite itself, plain DCP, torchtitan, Megatron-LM) produces a `Source`: the model dims in
megalite's terms, the shapes of the logical tensors ("param/<name>", "buffer/<name>" (a MoE router's bias),
"exp_avg/<name>", "exp_avg_sq/<name>", global and unpadded, megalite's layout: fused [q; k; v] rows, fused
[gate; up] rows, HF rotate-half RoPE order) and a `fetch` that produces one of them at a time, so a conversion
holds one tensor in memory where the source format allows it. Writers take a Source: `to_megalite` (any
tp/pp/vpp), and the DCP / torchtitan writers in their modules.

Nothing is dropped without a word: a reader refuses a tensor it has no place for, and lists in `dropped` the
non-tensor state it knowingly leaves behind (a scheduler, RNG states); a writer takes every key of `shapes` or
refuses (`claim`). What the optimizer state *means* travels with it: megalite keeps Muon's momentum in the
"exp_avg" slot (docs/muon.md), so `optimizer_kind` tells a writer whether "exp_avg" is Adam's first moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from megalite.checkpoint.offline import Carried, Target, write_checkpoint
from megalite.checkpoint.sharded import read_index
from megalite.checkpoint.storage import SlabReader
from megalite.config.aliases import saved_config
from megalite.errors import CheckpointError

KINDS = ("param", "buffer", "exp_avg", "exp_avg_sq")
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


@dataclass
class Source:
    info: dict[str, Any]                       # model dims, as a megalite index.json's "model"
    shapes: dict[str, tuple[int, ...]]         # logical key -> global shape
    fetch: Callable[[str], torch.Tensor]       # logical key -> full fp32 tensor
    step: int = 0
    optimizer_step: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    dropped: list[str] = field(default_factory=list)  # what the reader knowingly did not carry, one phrase each

    def params(self) -> list[str]:
        return [k.split("/", 1)[1] for k in self.shapes if k.startswith("param/")]

    def has_optimizer_state(self) -> bool:
        return any(k.startswith(OPTIMIZER_STATES) for k in self.shapes)


def optimizer_kind(extra: dict[str, Any]) -> str:
    """The optimizer whose state a checkpoint holds, from its run config ("adamw" when none is recorded: a
    checkpoint from before Muon, or one a tool wrote). The one place a conversion reads it."""
    section = saved_config(extra).get("optimizer")  # old configs' optimizer.name mapped to optimizer.name
    kind = section.get("name", "adamw") if isinstance(section, dict) else "adamw"
    if kind not in ("adamw", "muon"):
        raise CheckpointError(f"the checkpoint's run config names optimizer.name={kind!r}: its optimizer state "
                              "cannot be interpreted (expected adamw or muon); convert with --weights-only")
    return str(kind)


def refuse_moments_without_adam(full: dict[str, torch.Tensor], target: str) -> None:
    """Refuse to label as AdamW's a state that cannot be: Adam's second moment is > 0 wherever its first is not,
    so an "exp_avg" with an all-zero "exp_avg_sq" is Muon's momentum (a checkpoint saved without its run config,
    which would name the optimizer)."""
    lone = next((k for k in full if k.startswith("exp_avg/") and full[k].any()
                 and not full[f"exp_avg_sq/{k.split('/', 1)[1]}"].any()), None)
    if lone is not None:
        raise CheckpointError(f"the checkpoint's {lone} has no second moment (exp_avg_sq is all zero): it is not "
                              f"AdamW's state (Muon's momentum, saved without the run config that says so), which "
                              f"{target} cannot hold as AdamW's: convert with --weights-only")


def weights_only(source: Source) -> Source:
    """`source` without its optimizer state (the target starts the optimizer fresh), saying so."""
    if not source.has_optimizer_state():
        return source
    shapes = {k: s for k, s in source.shapes.items() if not k.startswith(OPTIMIZER_STATES)}
    try:
        what = f"the {optimizer_kind(source.extra)} optimizer state"
    except CheckpointError:  # an optimizer megalite does not know: dropping its state is what was asked
        what = "the optimizer state"
    return replace(source, shapes=shapes, optimizer_step=None, dropped=source.dropped + [f"{what} (--weights-only)"])


def claim(shapes: Iterable[str], taken: set[str], target: str) -> None:
    """Refuse the conversion when a writer would leave a key of the source behind (`taken`: what it writes)."""
    left = sorted(k for k in shapes if k not in taken)
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise CheckpointError(f"the checkpoint has {left[0]}{more}, which {target} has no place for: refusing to "
                              "drop it (--to megalite or --to dcp keep every tensor)")


def from_megalite(src: Path) -> Source:
    """A megalite checkpoint directory (any layout)."""
    index = read_index(src)
    reader = SlabReader(src, index)
    shapes = {k: tuple(v["shape"]) for k, v in index["tensors"].items()}
    unknown = sorted(k for k in shapes if k.split("/", 1)[0] not in KINDS)
    if unknown:
        reader.close()
        raise CheckpointError(f"{src}: tensor {unknown[0]} is of a kind this converter does not know (it knows "
                              f"{', '.join(KINDS)}): refusing to drop it")
    dropped = ["per-rank RNG states (a new layout re-seeds them)"] if index.get("rng_keys") else []
    return Source(index["model"], shapes, lambda k: reader.read_region(k, (0,) * len(shapes[k]), shapes[k]),
                  int(index["step"]), index.get("optimizer_step"), index.get("extra", {}), reader.close, dropped)


def to_megalite(source: Source, out: Path, tp: int = 1, pp: int = 1, vpp: int = 1,
                pp_layers: list[int] | None = None, show_progress: bool = True) -> Path:
    """Write `source` as a megalite checkpoint laid out for (tp, pp, vpp)."""
    try:
        claim(source.shapes, {k for k in source.shapes if k.split("/", 1)[0] in KINDS}, "a megalite checkpoint")
        return write_checkpoint(out, source.shapes, source.fetch, source.info, Target(tp, pp, vpp, pp_layers),
                                Carried(source.extra, source.step, source.optimizer_step), show_progress)
    finally:
        source.close()
