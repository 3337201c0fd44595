"""Pinned host staging for the mirror path: fenced slot rings and per-forward layouts.

A forward's host-computed data (token maps, MHA metadata) is written by the numba
kernels into a *shadow* of the destination view: the same ten fields, tightly packed,
each only as long as the forward writes it. The shadow lives in one pinned slot, so one
``non_blocking`` copy moves it to the device; a few device copies then scatter it into
the view (fields that sit side by side in the view, like upstream's, go as one strided
group copy). This is the FlashInfer ``plan()`` / kestrel ``PackedBuffer`` pattern.

Fencing: a slot is never rewritten while a copy from it may still be in flight. Each
slot owns a ``CopyFence`` recorded after its copies are issued; ``StagingRing.acquire``
waits on the fence of the slot it hands out (double buffering generalised to N slots).
On the CPU the fence is a no-op, but the ring's ordering is the same and unit-tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .runtime import CopyFence, DeviceRuntime, get_runtime

__all__ = ["CopyFence", "StagingRing", "BoundedCache", "ShadowLayout", "paired",
           "numpy_dtype"]

_ALIGN = 8


_NUMPY_DTYPES = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
                 torch.int64: np.int64, torch.uint8: np.uint8}
for _bits in (16, 32, 64):
    if hasattr(torch, f"uint{_bits}"):
        _NUMPY_DTYPES[getattr(torch, f"uint{_bits}")] = getattr(np, f"uint{_bits}")


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of an integer torch dtype."""
    return np.dtype(_NUMPY_DTYPES[dtype])


class StagingRing:
    """``num_slots`` pinned byte slots of ``slot_bytes`` each, handed out round robin.

    ``acquire()`` returns the next slot index after waiting on that slot's fence;
    ``release(slot)`` records the fence once the copies reading the slot are issued.
    """

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device,
                 runtime: Optional[DeviceRuntime] = None) -> None:
        runtime = runtime if runtime is not None else get_runtime()
        self.slot_bytes = slot_bytes
        # [num_slots, slot_bytes] uint8, page-locked (pinned) host memory from the runtime.
        self.host = runtime.host_empty((num_slots, max(slot_bytes, _ALIGN)), torch.uint8)
        self.host.zero_()
        self.host_np = self.host.numpy()
        self.slots: List[torch.Tensor] = [self.host[i] for i in range(num_slots)]
        self.fences = [runtime.fence(device) for _ in range(num_slots)]
        self._next = 0

    @property
    def num_slots(self) -> int:
        return len(self.fences)

    def acquire(self) -> int:
        slot = self._next
        self._next = (slot + 1) % len(self.fences)
        self.fences[slot].wait()
        return slot

    def release(self, slot: int) -> None:
        self.fences[slot].record()


class BoundedCache:
    """A small insertion-ordered cache of derived views (never of data)."""

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._entries: Dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        value = self._entries.get(key)
        if value is None:
            if len(self._entries) >= self._capacity:
                self._entries.pop(next(iter(self._entries)))
            value = build()
            self._entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()


@dataclass(frozen=True)
class ShadowLayout:
    """Tight byte layout of a shadow view: field ``i`` holds ``shapes[i]`` of
    ``dtypes[i]`` at byte ``offsets[i]`` (8-byte aligned); ``nbytes`` in all."""

    dtypes: Tuple[torch.dtype, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    offsets: Tuple[int, ...]
    nbytes: int

    @classmethod
    def build(cls, dtypes: Sequence[torch.dtype],
              shapes: Sequence[Tuple[int, ...]]) -> "ShadowLayout":
        offsets = []
        offset = 0
        for dtype, shape in zip(dtypes, shapes):
            offset = -(-offset // _ALIGN) * _ALIGN
            offsets.append(offset)
            offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return cls(tuple(dtypes), tuple(tuple(s) for s in shapes), tuple(offsets),
                   -(-offset // _ALIGN) * _ALIGN)

    def numpy_fields(self, slot_bytes: np.ndarray) -> Tuple[np.ndarray, ...]:
        """Typed numpy views of each field inside one host slot (no torch op)."""
        fields = []
        for dtype, shape, offset in zip(self.dtypes, self.shapes, self.offsets):
            np_dtype = numpy_dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            raw = slot_bytes[offset:offset + count * np_dtype.itemsize]
            fields.append(raw.view(np_dtype).reshape(shape))
        return tuple(fields)

    def tensor_fields(self, device_bytes: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Typed views of each field inside the device staging buffer."""
        fields = []
        for dtype, shape, offset in zip(self.dtypes, self.shapes, self.offsets):
            count = int(np.prod(shape, dtype=np.int64))
            raw = device_bytes[offset:offset + count * dtype.itemsize]
            fields.append(raw.view(dtype).view(shape))
        return tuple(fields)


def paired(first: torch.Tensor, second: torch.Tensor, length: int) -> Optional[torch.Tensor]:
    """``[2, length]`` strided view over ``first[:length]`` and ``second[:length]`` when
    they are 1-D, contiguous, of one dtype, in one storage, ``second`` after ``first``
    by at least ``length`` elements; else None. One copy then writes both."""
    if first.dim() != 1 or second.dim() != 1 or first.dtype != second.dtype:
        return None
    if not (first.is_contiguous() and second.is_contiguous()):
        return None
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    gap_bytes = second.data_ptr() - first.data_ptr()
    itemsize = first.element_size()
    if gap_bytes % itemsize:
        return None
    gap = gap_bytes // itemsize
    if gap < length or first.shape[0] < length or second.shape[0] < length:
        return None
    return torch.as_strided(first, (2, length), (gap, 1))
