"""mtpmeta: host-side bookkeeping for MTP speculative decoding with a draft KV cache.

A drop-in for upstream's pure-torch ``MTPMetadata`` whose host work runs in numba and
whose device writes are a few CUDA-graph-safe torch ops. See ``MTPMetadata``.

Import from a source tree without installing works too: with the repository root on
``PYTHONPATH`` (``PYTHONPATH=. python -m pytest``, as ``scripts/gpu_check.sh`` runs),
``mtpmeta.kernels`` loads the top-level ``native/`` folder as ``mtpmeta.native``.
"""


from mtpmeta.errors import (
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
from mtpmeta.gpu_view import VIEW_FIELDS, ContextGPUView
from mtpmeta.metadata import MTPMetadata
from mtpmeta.types import ForwardShape, MTPForwardMode

from mtpmeta._version import __version__

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
