"""megalite: readable, fast Megatron-style GPT pretraining."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

__version__ = "0.1.0"

# `megalite.kernels` is the repository's top-level kernels/ folder. An installed wheel holds it at
# megalite/kernels/ (pyproject's package-dir), so this does nothing there. Run from a source tree (the repo
# root on sys.path, or `pip install -e`), megalite/ has no kernels/ beside it: this finder, consulted for that
# one name only, loads kernels/ as the `megalite.kernels` package, lazily (at its first import). A finder
# rather than extending `__path__`, which would make every top-level folder (tools, bench...) a subpackage.
_SOURCE_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


class _SourceKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "megalite.kernels":
            return None
        return importlib.util.spec_from_file_location(fullname, _SOURCE_KERNELS / "__init__.py",
                                                      submodule_search_locations=[str(_SOURCE_KERNELS)])


if not (Path(__file__).resolve().parent / "kernels").is_dir() and (_SOURCE_KERNELS / "__init__.py").is_file():
    sys.meta_path.insert(0, _SourceKernelsFinder())
