"""`model.compile`: torch.compile each transformer block, as torchtitan does (one compiled region per block).

Why per block and not the whole model: every block has the same code and shapes, so dynamo traces one
block and reuses the compiled graph for all of them (torch keys the cache on the code object and guards
on what the block reads); the compile time does not grow with depth, and everything outside the blocks
(the pipeline engine, the embedding and the vocab-parallel loss) stays the eager code that its tests
compare byte for byte.

Why the block's `forward` and not its `__call__` (`nn.Module.compile` compiles `__call__`, hooks
included): ZeRO-3 gathers a block's weights in a forward pre-hook and frees them in a forward hook by
resizing storage (`megalite.dp.zero3`), and the pipeline engine and the gradient sync drive their
collectives from Python. Compiling only `forward` leaves every module hook eager around the graph, so
the compiled region sees fully gathered weights and issues exactly the collectives the eager block does.

What lands inside the graph (see docs/performance.md, "torch.compile", for the graph breaks dynamo
reports at each layout): the norms, RoPE, attention (SDPA), the SwiGLU / GeLU MLP, the residuals, the
TP/SP region operators (`megalite.parallel.comm`'s autograd functions: dynamo traces their forward and
backward up to the counted collectives they call, which run between graphs), the linears' autograd function
(`megalite.layers.linear_fn.LinearParts`, or FP8's where no scale is reduced over tp / cp), the document mask
and its masked SDPA. Not inside: a MoE feed-forward (`megalite.moe.layer`: its shapes follow the routing, so
it runs eagerly between the block's graphs) and context-parallel attention.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Iterable

import torch
import torch.nn as nn

from megalite.model.block import Block
from megalite.parallel.comm import keep_outside_graphs

BACKENDS = ("inductor", "aot_eager", "eager")  # inductor: generated kernels; the other two: tracing only


def cpu_compiler() -> tuple[str | None, list[str]]:
    """(the C++ compiler inductor will build its CPU kernels with, or None; the names it searches). The search
    list is inductor's own (`torch._inductor.config.cpp.cxx`: $CXX when set at import, else g++; None there
    is its opt-in conda download), each looked up as inductor runs it (a name on PATH or a path), so a missing
    or misnamed compiler is found before step 1 instead of as inductor's traceback during it."""
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx
    names: list[str | None] = list(cxx) if isinstance(cxx, (list, tuple)) else [cxx]
    for name in names:
        if name is None:
            if sys.platform == "linux" and os.getenv("TORCH_INDUCTOR_INSTALL_GXX"):
                return "g++ from conda (TORCH_INDUCTOR_INSTALL_GXX)", []
            continue
        if shutil.which(name):
            return name, []
    return None, [n for n in names if n is not None]


def compile_blocks(chunks: Iterable[nn.Module], backend: str = "inductor") -> int:
    """Replace each block's `forward` by its torch.compile'd self (module hooks stay eager); returns the count.

    `backend`: inductor (the default; CPU needs a C++ compiler, GPU Triton), or aot_eager / eager, which
    trace the same graphs (dynamo, and for aot_eager AOTAutograd's joint forward/backward) but run them with
    the eager kernels: for tests and for telling a tracing problem from a code-generation one."""
    if backend not in BACKENDS:
        raise ValueError(f"model.compile_backend={backend!r}: use one of {', '.join(BACKENDS)}")
    keep_outside_graphs()  # the counted collectives, cp attention, MoE layers: graph breaks (docs/performance.md)
    n = 0
    for chunk in chunks:
        for block in (m for m in chunk.modules() if isinstance(m, Block)):
            # An instance attribute shadows the class's forward; parameter names, state dicts and hooks
            # are untouched (torch.compile on the module would prefix every name with `_orig_mod.`).
            block.forward = torch.compile(block.forward, backend=backend)  # type: ignore[method-assign]
            n += 1
    return n
