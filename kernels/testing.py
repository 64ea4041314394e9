"""Test helpers: run the kernels in the Triton interpreter and check them against the references.

Used by tests/test_kernels_*.py and handy when adding a kernel: `check_against_reference` drives a
kernel and its reference with the same random upstream gradient (never `.sum()`, whose all-ones
gradient hides transposition and broadcasting bugs) and compares outputs and input gradients.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Callable, Sequence, cast

import torch

def use_interpreter() -> ModuleType:
    """Set TRITON_INTERPRET=1 and return the `kernels` package, checking that it can take effect.

    Triton chooses interpreter or compiled mode when its `@jit` functions are created: its own
    standard library at `import triton`, ours at the first launch. If triton was already imported
    in compiled mode by this process, the interpreter cannot be switched on any more.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        import triton.language.standard as standard

        if type(standard.sum).__name__ != "InterpretedFunction":
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; export "
                               "TRITON_INTERPRET=1 before starting python, or run the kernel tests alone")
    from megalite import kernels

    return kernels


def _as_tuple(x: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def check_against_reference(
    kernel: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    args: Sequence[object],
    grad_args: Sequence[int],
    atol: float,
    rtol: float,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> None:
    """Compare forward outputs and the gradients of args[i] for i in grad_args.

    The kernel runs on the inputs as given (fp32 or bf16); the reference runs on fp32 copies of
    the same values with the same upstream gradients, so the comparison measures the kernel's own
    error against fp32 math. Outputs must have `out_dtype` (default: the first input's dtype).
    Every tensor input is cloned per run (cross-entropy overwrites its logits with the gradient).
    """

    def run(fn: Callable[..., object], upcast: bool, grads_out: list[torch.Tensor] | None
            ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[torch.Tensor]]:
        call_args: list[object] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                a = a.detach().clone()
                if upcast and a.is_floating_point():
                    a = a.float()
                if i in grad_args:
                    a.requires_grad_(True)
            call_args.append(a)
        outs = _as_tuple(fn(*call_args))  # type: ignore[arg-type]
        if grads_out is None:
            gen = torch.Generator().manual_seed(seed)
            grads_out = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        else:
            grads_out = [g.to(o.dtype) for g, o in zip(grads_out, outs)]
        leaves = [call_args[i] for i in grad_args]
        grads = torch.autograd.grad(outs, leaves, grads_out)  # type: ignore[arg-type]
        return outs, list(grads), grads_out

    outs, grads, grads_out = run(kernel, upcast=False, grads_out=None)
    ref_outs, ref_grads, _ = run(reference, upcast=True, grads_out=grads_out)
    first = next(a for a in args if isinstance(a, torch.Tensor))
    expected = out_dtype if out_dtype is not None else first.dtype
    for idx, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == expected, f"output {idx} has dtype {o.dtype}, expected {expected}"
        torch.testing.assert_close(o.float(), r.float(), atol=atol, rtol=rtol, msg=lambda m: f"output {idx}: {m}")
    for i, g, r in zip(grad_args, grads, ref_grads):
        assert g.dtype == cast(torch.Tensor, args[i]).dtype, f"grad of arg {i} has dtype {g.dtype}"
        torch.testing.assert_close(g.float(), r.float(), atol=atol, rtol=rtol, msg=lambda m: f"grad of arg {i}: {m}")
