"""Activation recomputation (`model.recompute` none / selective / full) changes nothing but memory.

Recomputing in fp32 on CPU reruns the identical kernels on identical inputs (and the model replays its
dropout streams, so dropout draws the same mask), hence loss and every gradient are compared
bitwise. Memory is measured as the peak of the sum of bytes of tensors autograd holds for backward
(saved-tensor hooks see every tensor saved outside a checkpointed region, and checkpoint's own inputs):
with seq_len 64 the s^2 attention internals dominate, so selective (drop them) < none, and full
(keep only each block's input) < selective (Korthikanti et al. 2022, section 5).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg


class _SavedBytes:
    """Tracks the bytes of saved tensors alive (packed and not yet released) and their peak."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        box = _Box(t)
        n = t.numel() * t.element_size()
        self.alive += n
        self.peak = max(self.peak, self.alive)
        weakref.finalize(box, self._release, n)
        return box

    def _release(self, n: int) -> None:
        self.alive -= n

    @staticmethod
    def unpack(box: object) -> torch.Tensor:
        return box.t  # type: ignore[attr-defined]


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _run(mode: str, arch: str, dropout: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    cfg = tiny_model_cfg(arch, seq_len=64, recompute=mode, dropout=dropout, num_layers=2)
    state = ParallelState()
    model = GPT(cfg, state, seed=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
    meter = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(ids[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.peak


@pytest.mark.parametrize("arch,dropout", [("llama", 0.0), ("gpt2", 0.1)])
def test_recompute_is_exact_and_saves_memory(arch: str, dropout: float) -> None:
    results = {mode: _run(mode, arch, dropout) for mode in ("none", "selective", "full")}
    loss0, grads0, _ = results["none"]
    for mode in ("selective", "full"):
        loss, grads, _ = results[mode]
        assert torch.equal(loss, loss0), f"{mode}: loss {loss.item()} != {loss0.item()}"
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), f"{mode}: gradient of {name} differs"
    peaks = {mode: r[2] for mode, r in results.items()}
    assert peaks["selective"] < peaks["none"], peaks
    assert peaks["full"] < peaks["selective"], peaks


def _full_recompute_sp_dropout(rank: int) -> tuple[list[float], list[float]]:
    """Full recompute with SP and dropout: the tp-local dropout stream must be replayed exactly."""
    from megalite.model.gpt import GPT as _GPT
    from tests.parallel_utils import layout as _layout, tiny_model_cfg as _cfg

    grads = []
    for recompute in ("none", "full"):
        st = _layout(2, sp=True)
        model = _GPT(_cfg("llama", dropout=0.2, recompute=recompute), st, seed=9)
        ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))
        model(ids, ids).mean().backward()
        grads.append([p.grad.sum().item() for p in model.parameters()])
    return grads[0], grads[1]


def test_full_recompute_replays_tp_local_dropout(dist_world) -> None:
    for plain, recomputed in dist_world(2).run(_full_recompute_sp_dropout):
        assert plain == recomputed  # bitwise: same masks drawn in the recomputation
