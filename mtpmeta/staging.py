"""Pinned host staging for the mirror path: fenced slot rings and per-forward layouts.

A forward's host-computed data (token maps, MHA metadata) is written by the numba
kernels into a *shadow* of the destination view: the same ten fields, tightly packed,
each only as long as the forward writes it. The shadow lives in one pinned slot, so one
``non_blocking`` copy moves it to the device; a few device copies then scatter it into
the view (fields that sit side by side in the view, like upstream's, go as one strided
group copy). This is the FlashInfer ``plan()`` / kestrel ``PackedBuffer`` pattern.

Fencing: a slot is never rewritten while a copy from it may still be in flight. Each
slot owns a ``CopyFence`` (``mtpmeta.runtime``) recorded after every op that reads the
slot (or the slot's device-side stage) was issued; ``StagingRing.acquire`` waits on the
fence of the slot it hands out (double buffering generalised to N slots). On the CPU
the fence is a no-op; the CUDA-semantics simulator of the tests gives it real meaning.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .runtime import DeviceRuntime, get_runtime

__all__ = ["StagingRing", "BoundedCache", "paired"]

_ALIGN = 8


class StagingRing:
    """``num_slots`` pinned byte slots of ``slot_bytes`` each, handed out round robin.

    ``acquire()`` returns the next slot index after waiting on that slot's fence;
    ``release(slot)`` records the fence once every op reading the slot is issued. With
    ``device_twin`` each slot also owns ``device_slots[slot]``, a device buffer of the
    same size that the slot's H2D copy lands in and the device ops then read: one per
    slot, so a forward on another stream can never overwrite it mid-scatter, and it is
    covered by the same fence.
    """

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device,
                 runtime: Optional[DeviceRuntime] = None, *,
                 device_twin: bool = False) -> None:
        runtime = runtime if runtime is not None else get_runtime()
        self.slot_bytes = slot_bytes
        # [num_slots, slot_bytes] uint8, page-locked (pinned) host memory from the runtime.
        self.host = runtime.host_empty((num_slots, max(slot_bytes, _ALIGN)), torch.uint8)
        self.host.zero_()
        self.host_np = self.host.numpy()
        self.slots: List[torch.Tensor] = [self.host[i] for i in range(num_slots)]
        self.fences = [runtime.fence(device) for _ in range(num_slots)]
        # [num_slots, slot_bytes] uint8 on the device, or None.
        self.device_slots: Optional[torch.Tensor] = (
            torch.zeros((num_slots, max(slot_bytes, _ALIGN)), dtype=torch.uint8,
                        device=device) if device_twin else None)
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
