"""Fields of a config section: a dataclass field with the one-line doc `--help` prints (`metadata["doc"]`).

The sections live with their features (`megalite/moe/config.py`, `megalite/optim/config.py`, ...) and in
`megalite/config/schema.py`; all of them build their fields here, the one module every layer may import.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def doc_field(default: Any, doc: str) -> Any:
    """A dataclass field with its one-line `--help` doc."""
    return field(default=default, metadata={"doc": doc})


def doc_list(doc: str) -> Any:
    """A list field (empty by default) with its `--help` doc."""
    return field(default_factory=list, metadata={"doc": doc})
