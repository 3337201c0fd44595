"""Two small host inputs that cross to the persistent buffers through their own pinned
rings: a commit pass's prefill query lengths (``PrefillLengthsStaging``) and the chunk
carry's hidden state (``CarryStaging``). Each is one H2D copy from a fenced pinned
slot, so the caller may overwrite or free its array as soon as the call returns.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.device_runtime import DeviceRuntime
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.kernels import native
from mtpmeta.mirror.pinned_ring import StagingRing

__all__ = ["PrefillLengthsStaging", "CarryStaging"]


class PrefillLengthsStaging:
    """``ring``: ``num_slots`` pinned slots of ``[R + 1]`` int32, each viewed as int32
    once. ``stage`` writes a commit pass's query lengths into a slot and copies the
    ``m`` staged ones into ``buffers.query_lengths[:m]`` (one data op, none for
    ``m = 0``); the slot is released after the copy was issued."""

    def __init__(self, buffers: PersistentBuffers, runtime: DeviceRuntime, *,
                 max_requests: int, num_slots: int) -> None:
        self.buffers = buffers
        self.max_requests = max_requests
        self.ring = StagingRing(4 * (max_requests + 1), num_slots,
                                buffers.offsets.device, runtime)
        self._words = [slot.view(torch.int32) for slot in self.ring.slots]
        # Views by a name (a slot's at most) and a count <= R + 1: never evicted.
        self._views = BoundedCache((num_slots + 1) * (max_requests + 2))

    def stage(self, counts: np.ndarray, pad_tokens: int) -> int:
        """Stage the lengths of ``counts`` (and of the pad, ``pad_tokens``); returns how
        many were staged, as ``native.staging.stage_prefill_lengths``."""
        ring = self.ring
        slot = ring.acquire()
        staged = native.staging.stage_prefill_lengths(
            counts, pad_tokens, self.max_requests, ring.host_np[slot].view(np.int32))
        if staged:
            self._views.prefix("query_lengths", self.buffers.query_lengths, staged).copy_(
                self._views.prefix(slot, self._words[slot], staged), non_blocking=True)
        ring.release(slot)
        return staged


class CarryStaging:
    """``ring``: two pinned slots of ``[H]`` of the hidden dtype (``slots[i]``, typed
    views of the same bytes). ``copy`` writes a source into
    ``buffers.chunk_boundary_hidden``: one data op."""

    def __init__(self, buffers: PersistentBuffers, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self.device = buffers.offsets.device
        self.target = buffers.chunk_boundary_hidden
        hidden = self.target
        nbytes = hidden.numel() * hidden.element_size()
        self.ring = StagingRing(nbytes, 2, self.device, runtime)
        self.slots = [slot[:nbytes].view(hidden.dtype).view(hidden.shape)
                      for slot in self.ring.slots]

    def copy(self, source: Tensor) -> None:
        """Copy ``source`` (broadcastable to ``[1, 1, H]``) into the persistent carry.

        A device tensor is copied on the stream (ordered before any later use) and
        ``record_stream``-ed there, so the caching allocator keeps it alive for that copy
        even if its producer allocated it on another stream and frees it at once. A
        host tensor is first copied into a fenced pinned slot, so the async copy never
        reads pageable memory the caller may free or overwrite right after this call
        returns.
        """
        target = self.target
        if not self.runtime.is_host(source):
            target.copy_(source, non_blocking=True)
            self.runtime.record_stream(source, self.device)
            return
        ring = self.ring
        slot = ring.acquire()
        staged = self.slots[slot]
        if source.is_contiguous() and source.dtype == staged.dtype and \
                source.numel() == staged.numel():
            # A numpy byte copy into the pinned slot: no torch op, so the carry costs
            # one data op (the H2D copy). Views only: view(-1), view(uint8), detach.
            ring.host_np[slot][:staged.numel() * staged.element_size()] = \
                source.view(-1).view(torch.uint8).numpy()
        else:
            staged.copy_(source)  # broadcast or strided: torch does the gather
        target.copy_(staged, non_blocking=True)
        ring.release(slot)
