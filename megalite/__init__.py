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

# `megalite.kernels` is the Triton kernels folder: the repository's top-level kernels/ in a source tree (the
# repo root on sys.path, or `pip install -e`), megalite/kernels/ in a wheel (pyproject's package-dir).
#
# That folder has no `__init__.py`, on purpose. With one, it is a regular package named `kernels`, and from the
# checkout root (`python -m pytest`, `python -c`, a notebook) it would shadow PyPI's `kernels` distribution,
# which transformers imports. Without one, it can only ever be a PEP 420 namespace portion, which the import
# system takes for `import kernels` only when no regular package or module of that name exists anywhere on
# sys.path: it never shadows an installed distribution (tests/test_packaging.py holds this for every
# top-level name). The package's body lives in `kernels/_package.py`, and this finder, consulted for the one
# name `megalite.kernels` and placed ahead of the editable-install finder, loads it as the package's
# `__init__`, lazily (at its first import), with the folder as its submodule search path.
_HERE = Path(__file__).resolve().parent
_KERNELS = _HERE / "kernels" if (_HERE / "kernels" / "_package.py").is_file() else _HERE.parent / "kernels"


class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "megalite.kernels":
            return None
        return importlib.util.spec_from_file_location(fullname, _KERNELS / "_package.py",
                                                      submodule_search_locations=[str(_KERNELS)])


if (_KERNELS / "_package.py").is_file():
    sys.meta_path.insert(0, _KernelsFinder())
