"""mtpmeta: host-side bookkeeping for MTP speculative decoding with a draft KV cache.

A drop-in for upstream's pure-torch ``MTPMetadata`` whose host work runs in numba and
whose device writes are a few CUDA-graph-safe torch ops. See ``MTPMetadata``.
"""

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
