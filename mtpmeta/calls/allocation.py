"""``Allocation``: what one ``MTPMetadata.allocate`` holds, built in one place.

An allocation is born in ``allocate`` and dropped in ``deallocate`` (or replaced by the
next ``allocate``); nothing in it outlives it but the ``[R]`` annotation tensor, which
the next allocation under the same device runtime takes over (zeroed), so a reference
the caller kept to ``request_matched_prefix_blocks`` stays the live one.
``MTPMetadata._install`` hands it to the call groups, which bind the parts they use as
their own attributes (a hot call then reads one attribute, not a chain).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.buffers.grad_mode import kept_tensors
from mtpmeta.buffers.layout import dtype_range
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.calls.backend import Backend
from mtpmeta.calls.forward_memo import ForwardMemo
from mtpmeta.calls.inherited import InheritedCopies
from mtpmeta.direct.backend import DirectBackend
from mtpmeta.mirror.captured_route import CapturedRoute
from mtpmeta.validation.geometry import Geometry

__all__ = ["Allocation"]


class Allocation:
    """The buffers of one allocation and everything built over them.

    Fields (all fixed for the allocation's life):
        buffers: ``PersistentBuffers``: the fixed-address buffers (``[R]`` annotations,
            offsets, lengths and row ids, ``[R, W]`` block table, ``[1, 1, H]`` carry).
        backend: the ``DirectBackend`` or ``MirrorBackend`` that writes them.
        geometry: ``Geometry``, what the checks know of it.
        memo: ``ForwardMemo``: resolved views, shapes and slices of these buffers.
        captured: ``CapturedRoute``: the captured draft loop's device ops over them.
        inherited: ``InheritedCopies``: ``[R]`` scratches for forward records.

    Invariant: every field is built over ``buffers``, under the device runtime that was
    in effect when ``create`` ran (``mtpmeta.buffers.device_runtime``).
    """

    __slots__ = ("buffers", "backend", "geometry", "memo", "captured", "inherited")

    def __init__(self, buffers: PersistentBuffers, backend: Backend,
                 geometry: Geometry) -> None:
        self.buffers = buffers
        self.backend = backend
        self.geometry = geometry
        self.memo = ForwardMemo(buffers, geometry, backend.lifecycle)
        self.captured = CapturedRoute(buffers, block_size=geometry.block_size_tokens,
                                      dummy=geometry.dummy_block_idx,
                                      order=backend.stream_order)
        self.inherited = InheritedCopies(geometry.max_requests)

    @classmethod
    def create(cls, *, max_requests: int, max_kv_block_count: int,
               block_size_tokens: int, dummy_block_idx: int,
               block_table_dtype: torch.dtype, hidden_size: int,
               hidden_dtype: torch.dtype, device: torch.device, mirror: bool,
               max_tokens: int, staging_slots: int,
               kept: Optional[Tuple[torch.Tensor, Any]] = None) -> "Allocation":
        """New buffers on ``device`` with their backend (mirror or direct) and
        geometry, under the device runtime in effect now. The arguments are
        ``MTPMetadata``'s configuration and ``allocate``'s checked arguments;
        ``kept``: ``(annotations, runtime)`` of the last allocation, whose annotation
        tensor is taken over when it was made under this runtime. Every tensor is made
        outside ``torch.inference_mode`` (``kept_tensors``), whatever mode the caller is
        in: calls outside the mode may then write them too."""
        with kept_tensors():  # normal tensors in either grad mode (contract §1)
            runtime = get_runtime()
            annotations = kept[0] if kept is not None and kept[1] is runtime else None
            buffers = PersistentBuffers.allocate(
                max_requests=max_requests, max_kv_block_count=max_kv_block_count,
                dummy_block_idx=dummy_block_idx, block_table_dtype=block_table_dtype,
                hidden_size=hidden_size, hidden_dtype=hidden_dtype, device=device,
                runtime=runtime, annotations=annotations)
            if mirror:
                from mtpmeta.mirror.backend import MirrorBackend

                backend = MirrorBackend(buffers, max_requests=max_requests,
                                        block_size=block_size_tokens, dummy=dummy_block_idx,
                                        max_tokens=max_tokens, num_slots=staging_slots,
                                        runtime=runtime)
            else:
                backend = DirectBackend(buffers, max_requests=max_requests,
                                        block_size=block_size_tokens, dummy=dummy_block_idx)
            return cls(buffers, backend, Geometry(
                max_requests, max_kv_block_count, block_size_tokens, dummy_block_idx,
                hidden_size, hidden_dtype, buffers.offsets.device, bool(mirror),
                block_table_dtype, dtype_range(block_table_dtype), runtime))
