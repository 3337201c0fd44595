"""Packing named, typed fields into one byte buffer: the one layout routine.

``ContextGPUView`` (the destination view, from ``VIEW_FIELDS``) and the mirror path's
pinned shadows of it are both built here, so there is one place where field offsets
are computed and one place where typed per-field views are cut out of raw bytes. Fields
are always reached by name (``fields.mha_block_table``): the order of the entries only
decides where each field sits in memory.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

import numpy as np
import torch

from mtpmeta.buffers.grad_mode import kept_tensors

__all__ = ["PackedLayout", "record_type", "numpy_dtype", "round_up", "dtype_range",
           "is_int_dtype"]

_NUMPY_DTYPES = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
                 torch.int64: np.int64, torch.uint8: np.uint8}
for _bits in (16, 32, 64):
    if hasattr(torch, f"uint{_bits}"):
        _NUMPY_DTYPES[getattr(torch, f"uint{_bits}")] = getattr(np, f"uint{_bits}")


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value`` (``multiple >= 1``).

    >>> round_up(13, 8), round_up(16, 8), round_up(0, 8)
    (16, 16, 0)
    """
    return -(-value // multiple) * multiple


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of an integer torch dtype."""
    return np.dtype(_NUMPY_DTYPES[dtype])


@functools.lru_cache(maxsize=None)
def record_type(names: Tuple[str, ...]) -> Any:
    """The named-tuple type whose fields are ``names`` (one type per name set)."""
    return collections.namedtuple("Fields", names)


@dataclass(frozen=True)
class PackedLayout:
    """Field ``names[i]`` holds ``shapes[i]`` of ``dtypes[i]`` at byte ``offsets[i]``.

    ``align=0`` aligns each field to its own item size (the view's natural layout);
    ``align=8`` aligns every field to 8 bytes (a shadow whose dtypes may change per view).
    ``nbytes`` covers every field, rounded up to the alignment.
    """

    names: Tuple[str, ...]
    dtypes: Tuple[torch.dtype, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    offsets: Tuple[int, ...]
    nbytes: int

    @classmethod
    def build(cls, entries: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]],
              align: int = 0) -> "PackedLayout":
        offsets = []
        offset = 0
        widest = 1
        for _, dtype, shape in entries:
            step = align or dtype.itemsize
            widest = max(widest, step)
            offset = round_up(offset, step)
            offsets.append(offset)
            offset += math.prod(shape) * dtype.itemsize  # math.prod: np.prod costs ~20x
        return cls(tuple(e[0] for e in entries), tuple(e[1] for e in entries),
                   tuple(tuple(e[2]) for e in entries), tuple(offsets),
                   round_up(offset, widest))

    def _spans(self):
        for dtype, shape, offset in zip(self.dtypes, self.shapes, self.offsets):
            yield dtype, shape, offset, math.prod(shape) * dtype.itemsize

    def tensors(self, raw: torch.Tensor) -> Any:
        """Typed views of every field inside the ``uint8`` tensor ``raw``, by name
        (normal tensors in any grad mode: ``grad_mode``)."""
        if torch.is_inference_mode_enabled():  # one mode switch for every field's view
            with kept_tensors():
                return self.tensors(raw)
        views = [raw[offset:offset + size].view(dtype).view(shape)
                 for dtype, shape, offset, size in self._spans()]
        return record_type(self.names)(*views)

    def arrays(self, raw: np.ndarray) -> Any:
        """Typed numpy views of every field inside the ``uint8`` array ``raw`` (no torch
        op), by name."""
        views = [raw[offset:offset + size].view(numpy_dtype(dtype)).reshape(shape)
                 for dtype, shape, offset, size in self._spans()]
        return record_type(self.names)(*views)


def dtype_range(dtype: torch.dtype) -> Tuple[int, int]:
    """``(low, high)``, both inclusive: the values an integer torch dtype holds, e.g.
    ``(-128, 127)`` for ``torch.int8``."""
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def is_int_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an integer dtype (``bool`` is not)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
