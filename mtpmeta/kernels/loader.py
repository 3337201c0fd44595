"""Loading the numba kernels: ``native`` is the ``mtpmeta.native`` package.

An install (editable or not) maps the repository's top-level ``native/`` folder to
``mtpmeta.native``. A source-tree import (the repository root on ``PYTHONPATH``, no
install) has no such mapping, so the folder is loaded under that name here, once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["native"]

_NAME = "mtpmeta.native"


def _load_native() -> ModuleType:
    """``mtpmeta.native``: the installed mapping when there is one, else the source
    tree's ``native/`` folder loaded under that name."""
    if _NAME in sys.modules or importlib.util.find_spec(_NAME) is not None:
        return importlib.import_module(_NAME)
    folder = Path(__file__).resolve().parents[2] / "native"
    spec = importlib.util.spec_from_file_location(
        _NAME, folder / "__init__.py", submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ImportError(f"{_NAME}: not installed and no {folder}/__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module


native = _load_native()
