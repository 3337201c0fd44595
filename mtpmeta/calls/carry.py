"""``ChunkCarry``: the chunk-boundary carry (``carry_chunk_boundary``,
``take_chunk_boundary``, ``invalidate_chunk_boundary``).

A chunked prefill hands the hidden state at a chunk's last position to the chunk that
starts right after it. The carry is keyed by request id and position, not by row, so it
survives row moves; the hidden lives in the allocation's ``[1, 1, H]`` buffer, whose
address never changes.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from torch import Tensor

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.state import CallState, raise_unavailable
from mtpmeta.errors import CarryNotAllocatedError
from mtpmeta.kernels import native
from mtpmeta.validation.carry import check_carry, check_take
from mtpmeta.validation.geometry import Geometry

__all__ = ["ChunkCarry"]

_record, _invalidate = native.carry.record, native.carry.invalidate


class ChunkCarry:
    """The carry's keys and the buffer that holds its hidden.

    ``keys``: ``[3]`` int64 ``[valid, req_id, position]``, kept across allocations
    (``allocate`` and ``deallocate`` invalidate it: valid 0, keys -1). Binds the
    allocation's buffers, backend and ``Geometry`` (None without one). Invariant: a
    live carry (valid 1) was copied into this allocation's buffer.
    """

    __slots__ = ("_state", "keys", "_buffers", "_backend", "_geometry")

    def __init__(self, state: CallState) -> None:
        self._state = state
        self.keys = np.array([0, -1, -1], dtype=np.int64)
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind ``allocation`` (None: no buffers) and drop the carry."""
        self._buffers: Optional[PersistentBuffers] = None
        self._backend = self._geometry = None
        if allocation is not None:
            self._buffers = allocation.buffers
            self._backend = allocation.backend
            self._geometry: Optional[Geometry] = allocation.geometry
        _invalidate(self.keys)

    def invalidate(self) -> None:
        """Drop the carry: invalid, keys -1. The hidden buffer keeps its address."""
        _invalidate(self.keys)

    def carry(self, hidden: Tensor, req_id: Any, position: Any) -> None:
        """Copy ``hidden`` (any shape with ``hidden_size`` elements) into the persistent
        carry and record ``(req_id, position)``. No-op when disabled.

        Only a chunk whose seam is exactly ``position`` (``off == position + 1``) may
        take it. A host ``hidden`` on the mirror path is copied host-to-device.
        """
        if not self._state.enabled:
            return
        if self._buffers is None:
            raise_unavailable(self._state, "carry_chunk_boundary")
        source, req_id, position = check_carry(self._geometry, hidden, req_id, position)
        self._backend.carry_hidden(source)
        _record(self.keys, req_id, position)

    def take(self, req_id: Any, seam_position: Any) -> Tensor:
        """Return the ``[1, 1, hidden_size]`` carried hidden for this seam.

        Raises ``ChunkCarryError`` (an ``AssertionError``, raised explicitly so it holds
        under ``python -O``) when no carry is live, when it belongs to another request,
        or when it sits at another position than ``seam_position``.
        """
        buffers = self._buffers
        if buffers is None and self._state.enabled:
            raise CarryNotAllocatedError(
                f"take_chunk_boundary: buffers are not allocated (call allocate(device) "
                f"first), so no chunk-boundary carry is live for request {req_id}")
        check_take(self.keys, req_id, seam_position)
        order = None if self._backend is None else self._backend.stream_order
        if order is not None:  # the caller's reads follow the carry's copy
            order.enter_unless_capturing()
        return buffers.chunk_boundary_hidden
