"""Lazy Triton access shared by every kernel file.

`import megalite.kernels` must never import Triton:
- machines without Triton still get the plain-torch references (and the model its torch path);
- Triton decides between compiled and interpreter mode (TRITON_INTERPRET=1) when its `@jit`
  functions, its own standard library included, are created. Importing it only when the first
  kernel launches lets a test or script set TRITON_INTERPRET after `import megalite.kernels`.
Kernel files therefore decorate with `jit` from here (imported by name: a module aliased `triton`
would read as the real one), which records the function and builds the real `triton.jit` object
on first launch: at that moment every kernel of the module is built and
the module's globals are rebound (the kernels and `tl`), so kernels calling helper kernels and
`tl.*` inside kernel bodies resolve to the real objects; a helper kernel imported from another kernel
file has that file's globals rebound too (its body reads `tl` there). Host code only needs `cdiv` and
`next_power_of_2`, which are plain Python here. Kernel files use `from __future__ import
annotations`, so `x: tl.constexpr` annotations stay strings (Triton reads them as strings).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch


def have_triton() -> bool:
    """Whether Triton is installed, without importing it."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs (or will run) in its numpy interpreter, i.e. on a CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class LazyKernel:
    """What `jit` returns: becomes a real Triton kernel on the first `kernel[grid](...)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        module_globals = self.fn.__globals__
        _materialize(module_globals)
        return module_globals[self.__name__][grid]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__} is a Triton kernel: launch it as {self.__name__}[grid](...)")


def jit(fn: Callable[..., Any]) -> LazyKernel:
    """Stand-in for `@triton.jit` (see the module docstring)."""
    return LazyKernel(fn)


def _materialize(module_globals: dict[str, Any]) -> None:
    """Replace every LazyKernel of a kernel module by `triton.jit(fn)` and bind the real `tl`."""
    if not have_triton():
        raise RuntimeError("the Triton kernels need triton (pip install triton, Linux); "
                           "use model.kernels='torch' or the *_reference functions instead")
    if not torch.cuda.is_available() and not interpreting():
        raise RuntimeError("Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run them "
                           "(slowly) on the CPU; use model.kernels='torch' otherwise")
    import triton
    import triton.language

    module_globals["tl"] = triton.language  # first: marks this module built (helper modules may import ours)
    for name, value in list(module_globals.items()):
        if isinstance(value, LazyKernel):
            helper_globals = value.fn.__globals__
            if helper_globals.get("tl") is not triton.language:  # a helper kernel of another file: its `tl` too
                _materialize(helper_globals)
            module_globals[name] = triton.jit(value.fn)


class _LanguagePlaceholder:
    """`tl` before the first launch: kernel bodies only run after `_materialize` rebinds it."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"tl.{name} used outside a Triton kernel before any kernel was launched")


tl: Any = _LanguagePlaceholder()


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether matmul operands must be cast to fp32 before `tl.dot`.

    On a GPU, bf16/fp16 operands go to the tensor cores as they are (fp32 accumulation). The
    interpreter computes with numpy, which has no bf16: a bf16 `tl.dot` there returns garbage, so
    under the interpreter the operands are upcast first.
    """
    return dtype == torch.float32 or interpreting()


def num_row_programs(n_rows: int, device: torch.device) -> int:
    """Programs for the persistent norm-backward kernel: a few per SM on a GPU, few on a CPU.

    Each program sums dW/db over its rows into one row of a [programs, H] buffer that torch then
    reduces: deterministic (no atomics) and the buffer stays small.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 4))


def row_blocks(n_cols: int, n_rows: int) -> tuple[int, int, int]:
    """Tile for the row-wise norm kernels: (BLOCK_M rows, BLOCK_N cols, warps).

    A whole row sits in one tile (BLOCK_N >= n_cols). Small rows are packed BLOCK_M to a program
    so that a hidden size of 64 still moves ~4K elements per program instead of idling the SM.
    """
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(4096 // block_n, next_power_of_2(n_rows), 64))
    elems = block_m * block_n
    warps = 4 if elems <= 4096 else 8 if elems <= 16384 else 16
    return block_m, block_n, warps
