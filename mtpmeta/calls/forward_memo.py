"""What ``MTPMetadata`` memoizes for one allocation: resolved destination views,
``ForwardShape``s, and slices of the persistent buffers.

Everything here is built on demand (the draft loop's active views for every n at
once, when the memo is made) and dies with the allocation. A step resolves the
same view four times, draws a shape that repeats step after step, and slices the same
buffers at the same counts; building those again each call would cost more than the
kernels that follow (a frozen dataclass alone costs about 1 µs).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

from torch import Tensor

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.validation.checks import check_view_device
from mtpmeta.validation.geometry import Geometry
from mtpmeta.gpu_view import ViewCache, ViewTarget
from mtpmeta.types import ForwardShape

__all__ = ["ForwardMemo", "ActiveViews"]

# offsets[:n], block_table[:n], (query_lengths[:n], kv_lengths[:n])
ActiveViews = Tuple[Tensor, Tensor, Tuple[Tensor, Tensor]]
_MAX_SHAPES = 4096


class ForwardMemo:
    """Memo of one allocation (``buffers``, checked against ``geometry``).

    Holds ``active`` (``ActiveViews`` by n: ``offsets[:n]``, ``block_table[:n]``,
    ``(query_lengths[:n], kv_lengths[:n])``), ``shapes`` (``ForwardShape`` by its six
    fields), the prefill views ``query_lengths[:m]`` by m, and the resolved
    destination views. Invariant: every entry is a view of, or a value derived from,
    this allocation's buffers; none is data.
    """

    __slots__ = ("_buffers", "_geometry", "_views", "_last_view", "shapes", "_prefill",
                 "active", "narrow_table")

    def __init__(self, buffers: PersistentBuffers, geometry: Geometry,
                 lifecycle: DeviceLifecycle) -> None:
        self._buffers = buffers
        self._geometry = geometry
        self._views = ViewCache(drop=lifecycle.drop)
        # The last resolved view: (weakref to it, its target, the target's generation).
        # It skips the cache's lookup, its weakref and bound-method setup.
        self._last_view: Optional[Tuple[Any, ViewTarget, Optional[int]]] = None
        # Whether the last resolved view's mha_block_table holds fewer block ids than
        # block_table_dtype (a draft depth then scans its rows: check_draft_blocks).
        self.narrow_table = False
        # ForwardShape by its fields; a hot path reads it first (dict.get in C) and
        # calls ``shape`` on a miss.
        self.shapes = BoundedCache(_MAX_SHAPES)
        self._prefill = BoundedCache(_MAX_SHAPES)  # query_lengths[:m] by m
        self.active = BoundedCache(_MAX_SHAPES)  # ActiveViews by n; ``add_active`` fills it
        for count in range(min(buffers.offsets.shape[0], _MAX_SHAPES - 1) + 1):
            self.add_active(count)  # every n now: a draft loop of a new n builds none

    def target(self, gpu_view: Any) -> ViewTarget:
        """``gpu_view`` resolved (and checked to sit on the buffers' device)."""
        last = self._last_view
        if last is not None:
            ref, target, generation = last
            if ref() is gpu_view and (gpu_view.field_generation == generation
                                      if generation is not None
                                      else target.still_matches(gpu_view)):
                return target
        target = self._views.resolve(gpu_view, self._accept)
        low, high = self._geometry.table_range
        row_low, row_high = target.table_block_range
        self.narrow_table = low < row_low or high > row_high
        try:  # the generation is the target's: set only for an exact ContextGPUView
            self._last_view = (weakref.ref(gpu_view), target, target.generation)
        except TypeError:  # no weak references to this view type: resolve every time
            self._last_view = None
        return target

    def _accept(self, target: ViewTarget) -> None:
        check_view_device(self._geometry, target)

    def shape(self, *fields: Any) -> ForwardShape:
        """``ForwardShape(*fields)``, built once per distinct shape."""
        shape = self.shapes.get(fields)
        if shape is None:
            shape = ForwardShape(*fields)
            self.shapes.put(fields, shape)
        return shape

    def prefill_view(self, length: int) -> Tensor:
        """``query_lengths[:length]``."""
        view = self._prefill.get(length)
        if view is None:
            view = self._buffers.query_lengths[:length]
            self._prefill.put(length, view)
        return view

    def add_active(self, count: int) -> ActiveViews:
        """The draft loop's views at ``n = count`` (callers read ``active`` first)."""
        buffers = self._buffers
        views = (buffers.offsets[:count], buffers.block_table[:count],
                 (buffers.query_lengths[:count], buffers.kv_lengths[:count]))
        self.active.put(count, views)
        return views
