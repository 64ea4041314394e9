"""A checkpoint of any format seen as megalite's logical tensors, and the writer of a megalite checkpoint from it.

Every reader (megalite itself, plain DCP, torchtitan, Megatron-LM) produces a `Source`: the model dims in
megalite's terms, the shapes of the logical tensors ("param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>",
global and unpadded, megalite's layout: fused [q; k; v] rows, fused [gate; up] rows, HF rotate-half RoPE
order) and a `fetch` that produces one of them at a time, so a conversion holds one tensor in memory where
the source format allows it. Writers take a Source: `to_megalite` (any tp/pp/vpp), and the DCP / torchtitan
writers in their modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from megalite.checkpoint.offline import Carried, Target, write_checkpoint
from megalite.checkpoint.sharded import read_index
from megalite.checkpoint.storage import SlabReader


@dataclass
class Source:
    info: dict[str, Any]                       # model dims, as a megalite index.json's "model"
    shapes: dict[str, tuple[int, ...]]         # logical key -> global shape
    fetch: Callable[[str], torch.Tensor]       # logical key -> full fp32 tensor
    step: int = 0
    optimizer_step: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None

    def params(self) -> list[str]:
        return [k.split("/", 1)[1] for k in self.shapes if k.startswith("param/")]


def from_megalite(src: Path) -> Source:
    """A megalite checkpoint directory (any layout)."""
    index = read_index(src)
    reader = SlabReader(src, index)
    shapes = {k: tuple(v["shape"]) for k, v in index["tensors"].items()}
    return Source(index["model"], shapes, lambda k: reader.read_region(k, (0,) * len(shapes[k]), shapes[k]),
                  int(index["step"]), index.get("optimizer_step"), index.get("extra", {}), reader.close)


def to_megalite(source: Source, out: Path, tp: int = 1, pp: int = 1, vpp: int = 1,
                pp_layers: list[int] | None = None, show_progress: bool = True) -> Path:
    """Write `source` as a megalite checkpoint laid out for (tp, pp, vpp)."""
    try:
        return write_checkpoint(out, source.shapes, source.fetch, source.info, Target(tp, pp, vpp, pp_layers),
                                Carried(source.extra, source.step, source.optimizer_step), show_progress)
    finally:
        source.close()
