"""The whole model with model.kernels=triton (CPU interpreter) equals model.kernels=torch.

Tolerance (fp32): the kernels compute the same functions with different blockings (online softmax
over vocabulary and key blocks, per-program partial sums for norm weight gradients), so results
differ by accumulated fp32 round-off, ~1e-7 relative per op; after 3 AdamW steps at lr 1e-2 the
losses agree to 1e-5 (an error in any kernel's forward or backward shows up as >= 1e-3).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
kernels = pytest.importorskip("megalite.kernels")  # the module the model calls (monkeypatched below)

from megalite.context.options import ContextOptions  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training.step import train_step  # noqa: E402
from tests.parallel_utils import layout, reference_optimizer, step_context, tiny_model_cfg, tiny_train_cfg  # noqa: E402

if not kernels.available():
    pytest.skip("triton is not installed", allow_module_level=True)


# 8 tokens (one masked 16-wide attention tile) where nothing needs more: the interpreter's cost grows with
# the programs launched, batch x sequence for RoPE and the cross-entropy (suite time). Document masking: one
# row of 16 (every row gets the same documents, so a second row would add programs, not a case).
SEQ, DOC_SEQ = 8, 16


def _cfg(kind: str, arch: str, seq_len: int = SEQ):
    return tiny_model_cfg(arch, kernels=kind, hidden_size=64, num_heads=4, num_kv_heads=2 if arch == "llama" else 4,
                          num_layers=2, seq_len=seq_len)


def _losses(kind: str, arch: str, state: ParallelState, steps: int = 3, eod: int | None = None,
            seq_len: int = SEQ, rows: int = 2) -> list[float]:
    cfg = _cfg(kind, arch, seq_len)
    model = GPT(cfg, state, seed=3, context=ContextOptions(document_eod=eod))
    opt = reference_optimizer(model, state)
    gen = torch.Generator().manual_seed(4)
    out = []
    for i in range(steps):
        d = torch.randint(1, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=gen)
        if eod is not None:  # documents of 3, 7 and 6 tokens (boundaries inside the kernel's 16-wide tiles)
            d[:, [2, 9]] = eod
        out.append(train_step(step_context(model, state, torch.float32, tiny_train_cfg(steps)),
                              opt, [(d[:, :-1], d[:, 1:])], i).loss)
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Calls of these kernels from now on (get_ops reads the package's attributes when it runs)."""
    calls = {name: 0 for name in names}
    for name in names:
        def counting(*args: object, _real=getattr(kernels, name), _name=name) -> object:
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(kernels, name, counting)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_triton_model_matches_torch(arch: str, monkeypatch) -> None:
    """3 AdamW steps; and the parity would also hold if the model never called the fused residual add + norm
    kernel: count its calls (one per block and forward)."""
    calls = count_calls(monkeypatch, "add_rms_norm", "add_layer_norm")
    ref, tri = _losses("torch", arch, ParallelState()), _losses("triton", arch, ParallelState())
    assert tri == pytest.approx(ref, abs=1e-5)
    fused = "add_rms_norm" if arch == "llama" else "add_layer_norm"
    assert calls == {"add_rms_norm": 0, "add_layer_norm": 0, fused: 3 * _cfg("triton", arch).num_layers}


def test_triton_model_under_document_masking_matches_torch() -> None:
    """data.document_mask: the flash kernel's segment ids (Ops.document_attention) against the torch path's masked
    SDPA, 2 AdamW steps (the second loss holds the gradients to account); and the masked losses differ from the
    unmasked ones (the mask is in effect)."""
    doc = dict(seq_len=DOC_SEQ, rows=1)
    ref, tri = (_losses(kind, "llama", ParallelState(), steps=2, eod=0, **doc) for kind in ("torch", "triton"))
    assert tri == pytest.approx(ref, abs=1e-5)
    assert abs(ref[0] - _losses("torch", "llama", ParallelState(), steps=1, **doc)[0]) > 1e-4


def _tp2_losses(rank: int, arch: str, sp: bool) -> list[float]:
    os.environ["TRITON_INTERPRET"] = "1"
    return _losses("triton", arch, layout(2, sp=sp), steps=2)


@pytest.mark.parametrize("arch,sp", [("llama", False), ("gpt2", True)])
def test_triton_model_at_tp2_matches_single_process(dist_world, arch: str, sp: bool) -> None:
    """Includes the vocab-parallel cross-entropy kernel with its TP all-reduces (prime-ish vocab 61), and
    with SP the fused add + LayerNorm on sequence slices."""
    single = _losses("torch", arch, ParallelState(), steps=2)  # once, here, not on each rank
    for tp2 in dist_world(2).run(_tp2_losses, arch, sp):
        assert tp2 == pytest.approx(single, abs=1e-5)
