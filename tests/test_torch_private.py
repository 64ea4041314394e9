"""The private torch APIs megalite relies on all live in `megalite.torch_private`: this fails, naming the API,
on a torch that lacks a required one, and nothing else in the package reaches into torch's private names."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megalite import torch_private

PACKAGE = Path(__file__).resolve().parents[1] / "megalite"


def test_this_torch_has_every_private_api_megalite_uses() -> None:
    assert torch_private.missing() == [], (f"torch {torch.__version__} lacks {torch_private.missing()}: "
                                           "megalite.torch_private needs a replacement for it")


def test_missing_names_an_api_that_is_not_there(monkeypatch) -> None:
    """The check above can fail: a torch without the fused AdamW kernel is reported by name."""
    monkeypatch.delattr(torch, "_fused_adamw_")
    assert torch_private.missing() == ["torch._fused_adamw_"]


def test_no_private_torch_api_outside_the_wrapper() -> None:
    private = re.compile(r"torch\._(?!C\b)[a-z]\w*\(|torch\._C\._\w+|_execution_engine")
    # torch._foreach_* are documented building blocks of torch.optim (used for the norms); allowed.
    hits = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
            for p in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "kernels").rglob("*.py")] if p != PACKAGE / "torch_private.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if private.search(line) and "_foreach_" not in line]
    assert not hits, hits
