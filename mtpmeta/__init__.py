"""mtpmeta: host-side bookkeeping for MTP speculative decoding with a draft KV cache.

A drop-in for upstream's pure-torch ``MTPMetadata`` whose host work runs in numba and
whose device writes are a few CUDA-graph-safe torch ops. See ``MTPMetadata``.

Import from a source tree without installing: with the repository root on
``PYTHONPATH`` (``PYTHONPATH=. python -m pytest``, as ``scripts/gpu_check.sh`` runs),
the kernels' top-level ``native/`` folder, which an install maps to ``mtpmeta.native``,
is loaded as ``mtpmeta.native`` at import (a private loader, deleted once it ran, so
``help(mtpmeta)`` shows the public API only).
"""


def _load_source_tree_native() -> None:
    """Load ``<repo>/native`` as ``mtpmeta.native`` when no installed mapping finds it
    (a source-tree import); an installed or editable package is left alone."""
    import importlib.util
    import sys
    from pathlib import Path

    if "mtpmeta.native" in sys.modules or importlib.util.find_spec(__name__ + ".native"):
        return
    folder = Path(__file__).resolve().parent.parent / "native"
    spec = importlib.util.spec_from_file_location(
        __name__ + ".native", folder / "__init__.py",
        submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ImportError(f"mtpmeta.native: not installed and no {folder}/__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["native"] = module


_load_source_tree_native()
del _load_source_tree_native  # private: keep it out of help(mtpmeta) and dir(mtpmeta)

from .errors import (
    CarryNotAllocatedError,
    ChunkCarryError,
    ForwardModeError,
    GraphCaptureError,
    InvalidDtypeError,
    InvariantError,
    MTPDisabledError,
    NotAllocatedError,
    StaleOffsetsError,
)
from .gpu_view import VIEW_FIELDS, ContextGPUView
from .metadata import MTPMetadata
from .types import ForwardShape, MTPForwardMode

__version__ = "0.1.0"

__all__ = [
    "MTPForwardMode",
    "MTPMetadata",
    "ContextGPUView",
    "ForwardShape",
    "VIEW_FIELDS",
    "CarryNotAllocatedError",
    "ChunkCarryError",
    "ForwardModeError",
    "GraphCaptureError",
    "InvalidDtypeError",
    "InvariantError",
    "MTPDisabledError",
    "NotAllocatedError",
    "StaleOffsetsError",
]
