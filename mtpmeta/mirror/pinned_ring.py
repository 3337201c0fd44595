"""Pinned host staging for the mirror path: fenced slot rings and per-forward layouts.

A forward's host-computed data (token maps, MHA metadata) is written by the numba
kernels into a *shadow* of the destination view: the same ten fields, tightly packed,
each only as long as the forward writes it. The shadow lives in one pinned slot, so one
``non_blocking`` copy moves it to the device; a few device copies then scatter it into
the view (fields that sit side by side in the view, like upstream's, go as one strided
group copy). This is the FlashInfer ``plan()`` / kestrel ``PackedBuffer`` pattern.

Fencing: a slot is never rewritten while a copy from it may still be in flight. Each
slot owns a ``CopyFence`` (``mtpmeta.buffers.device_runtime``) recorded after every op that reads the
slot (or the slot's device-side stage) was issued; ``StagingRing.acquire`` waits on the
fence of the slot it hands out (double buffering generalised to N slots). On the CPU
the fence is a no-op; the CUDA-semantics simulator of the tests gives it real meaning.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from mtpmeta.buffers.device_runtime import DeviceRuntime, get_runtime

__all__ = ["StagingRing", "grouped"]

_ALIGN = 8


class StagingRing:
    """``num_slots`` pinned byte slots of ``slot_bytes`` each, handed out round robin.

    ``acquire()`` returns the next slot index after waiting on that slot's fence;
    ``release(slot)`` records the fence once every op reading the slot is issued. With
    ``device_twin`` each slot also owns ``device_slots[slot]``, a device buffer of the
    same size that the slot's H2D copy lands in and the device ops then read: one per
    slot, so a forward on another stream can never overwrite it mid-scatter, and it is
    covered by the same fence. ``zone`` is one more such device buffer, shared by every
    slot (the fixed stages of ``stages`` land there): its users order its
    reuse across streams themselves (``StreamOrder``), never by a fence.
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
        # [slot_bytes] uint8 on the device, or None.
        self.zone: Optional[torch.Tensor] = (
            torch.zeros(max(slot_bytes, _ALIGN), dtype=torch.uint8, device=device)
            if device_twin else None)
        # Prefix views of the zone and of persistent buffers that the fixed stages of
        # every view share (``stages.shared_prefixes``), and how many were built.
        self.shared_prefixes: Dict[Any, Any] = {}
        self.shared_built = [0]
        self._next = 0
        # Per slot: ``(offset, owner)`` saying the slot's bytes from ``offset`` on are
        # what ``owner`` last wrote there (None: unknown); see ``acquire``.
        self.marks: List[Optional[tuple]] = [None] * num_slots
        self.last_mark: Optional[tuple] = None

    @property
    def num_slots(self) -> int:
        return len(self.fences)

    def acquire(self, written: Optional[int] = None) -> int:
        """The next slot, after its fence. The caller writes the slot's bytes
        ``[:written]`` (None: anywhere): a mark whose offset is at or past ``written``
        survives, any other is dropped; ``last_mark`` is the slot's mark before."""
        slot = self._next
        self._next = (slot + 1) % len(self.fences)
        self.fences[slot].wait()
        mark = self.last_mark = self.marks[slot]
        if mark is not None and (written is None or written > mark[0]):
            self.marks[slot] = None
        return slot

    def release(self, slot: int) -> None:
        self.fences[slot].record()


def grouped(parts: Sequence[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """``[k, length]`` strided view over ``parts[i][:length]`` when the ``k`` parts are
    1-D, contiguous, of one dtype, in one storage, and each starts the same number of
    elements (at least ``length``) after the one before; else None. One copy then
    writes all of them.

    Example: a view's four int32 token parts, ``max_tokens`` apart, give a
    ``[4, length]`` view with strides ``(max_tokens, 1)``.
    """
    first = parts[0]
    if any(f.dim() != 1 or f.dtype != first.dtype or not f.is_contiguous() or
           f.shape[0] < length for f in parts):
        return None
    storage = first.untyped_storage().data_ptr()
    if any(f.untyped_storage().data_ptr() != storage for f in parts[1:]):
        return None
    itemsize = first.element_size()
    gap_bytes = parts[1].data_ptr() - first.data_ptr() if len(parts) > 1 else length * itemsize
    if gap_bytes % itemsize or gap_bytes < length * itemsize:
        return None
    for before, after in zip(parts, parts[1:]):
        if after.data_ptr() - before.data_ptr() != gap_bytes:
            return None
    return torch.as_strided(first, (len(parts), length), (gap_bytes // itemsize, 1))
