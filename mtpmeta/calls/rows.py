"""``RowLifecycle``: the row-lifecycle calls (``reset_request_rows``,
``move_request_rows``, ``swap_request_rows``) on the ``[R]`` int32 annotations
(``request_matched_prefix_blocks``).

Each validates its indices at the boundary (``mtpmeta.validation``), then runs one
``native.rows`` kernel, which scans every index before its first write: a refused call
leaves the annotations as they were.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.state import CallState, raise_unavailable
from mtpmeta.kernels import native
from mtpmeta.validation.request_rows import RequestRows, refuse_repeated_rows
from mtpmeta.validation.geometry import Geometry
from mtpmeta.validation.inputs import as_row_indices, raise_row_out_of_range
from mtpmeta.validation.rows import check_row_pair, raise_refused_row_pair

__all__ = ["RowLifecycle"]

# The kernels, bound once (a module attribute chain costs two lookups per call).
_move_rows, _swap_rows, _reset_rows = (native.rows.move_rows, native.rows.swap_rows,
                                       native.rows.reset_rows)


class RowLifecycle:
    """Resets, moves and swaps of annotation rows.

    Holds the allocation's ``annotations`` (``[R]`` int32 host array, a view of
    ``request_matched_prefix_blocks``), its ``row_scratch`` (``[2R]`` int32 snapshot
    space) and its ``Geometry``; all None without an allocation. Invariant: every
    source row is read before any destination row is written.
    """

    __slots__ = ("_state", "_annotations", "_scratch", "_geometry", "kept")

    def __init__(self, state: CallState) -> None:
        self._state = state
        self.kept: Optional[Tuple[Any, Any]] = None
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind the rows of ``allocation`` (None: no buffers). ``kept``: the
        annotation tensor of the last allocation and its device runtime, which the
        next allocation takes over (``Allocation.create``)."""
        if allocation is None:
            self._annotations = self._scratch = self._geometry = None
        else:
            self.kept = (allocation.buffers.request_matched_prefix_blocks,
                         allocation.geometry.runtime)
            self._annotations = allocation.buffers.annotations
            self._scratch = allocation.buffers.row_scratch
            self._geometry: Optional[Geometry] = allocation.geometry

    def reset(self, request_indexes: Any) -> None:
        """Clear annotations of released/reused rows: ``x[request_indexes] = 0``.

        Takes a slice, an int, a sequence, a numpy array, a tensor (a device tensor is
        read back, one sync) or a boolean mask. No-op when disabled.
        """
        if not self._state.enabled:
            return
        annotations = self._annotations
        if annotations is None:
            raise_unavailable(self._state, "reset_request_rows")
        max_requests = self._geometry.max_requests
        rows = as_row_indices(request_indexes, max_requests, "request_indexes")
        if type(rows) is slice:
            annotations[rows] = 0
        else:
            bad = _reset_rows(annotations, rows)
            if bad >= 0:  # refused before any write
                raise_row_out_of_range(rows, bad, max_requests, "request_indexes")
        self._state.committed = None  # rows changed: the pass's spans name old rows

    def move(self, src_idxs: Any, dst_idxs: Any) -> None:
        """``x[dst] = x[src]``: every source is read before any destination is written,
        so overlapping ranges are safe; sources keep their values. A row named twice in
        ``dst_idxs`` is refused (``ValueError``, nothing changed). No-op when disabled."""
        if not self._state.enabled:
            return
        annotations = self._annotations
        if annotations is None:
            raise_unavailable(self._state, "move_request_rows")
        src, dst = check_row_pair(self._geometry, "move_request_rows", src_idxs, dst_idxs)
        # two sources into one row would keep one of them: the other annotation is lost
        refuse_repeated_rows("move_request_rows", dst, self._geometry.max_requests,
                             "dst_idxs")
        scratch = self._scratch
        if len(src) > len(scratch):
            scratch = np.empty(len(src), dtype=np.int32)
        bad = _move_rows(annotations, src, dst, scratch)
        if bad >= 0:  # refused before any write
            raise_refused_row_pair(self._geometry, src, dst, bad)
        self._state.committed = None

    def declare_split(self, max_requests: int, paused_count: Any, total_count: Any) -> None:
        """Declare this step's row split: rows ``[0, paused_count)`` paused,
        ``[paused_count, total_count)`` active (``0 <= paused <= total <= R``, ints);
        ``draft_annotation_offset`` becomes ``paused_count``.

        The split serves the step's ``setup_commit_pass`` (at most one) and then its
        ``begin_decode``, which ends it (as does a re-allocation); from then on both
        refuse until the next declaration, so declare it every step. While it lives:
        a per-request array of exactly ``R`` rows (``start_positions``,
        ``block_table_src``, ``block_table``, ``inherited_blocks``, ``block_counts``) is
        the context's whole array and gives its rows ``[paused, paused + P)`` (``P``:
        ``n``, or ``len(append_counts)``), which must fit the active rows; any other
        length is the active slice (pass an ``R``-row array of your own, holding the
        requests from row 0, as ``array[:P]``). The commit pass redirects by the
        annotation rows ``[paused, paused + P)`` unless ``inherited_blocks`` is given;
        ``begin_decode`` refuses a host start inside a row's inherited blocks or inside
        the span the commit pass just before wrote for it. Bad counts raise before
        anything changes."""
        state = self._state
        split = state.split
        if split is not None and type(paused_count) is int and type(total_count) is int \
                and split.paused == paused_count and split.total == total_count \
                and split.max_requests == max_requests:
            split.committed = False  # the live split again (the begin after the pass)
        else:
            split = state.split = RequestRows(max_requests, paused_count, total_count)
        state.split_ended = False
        state.annotation_offset = split.paused

    def swap(self, src_idxs: Any, dst_idxs: Any) -> None:
        """Swap annotations: both sides read first, then ``x[dst] = old[src]``, then
        ``x[src] = old[dst]`` (an index on both sides keeps the second assignment).
        No-op when disabled."""
        if not self._state.enabled:
            return
        annotations = self._annotations
        if annotations is None:
            raise_unavailable(self._state, "swap_request_rows")
        src, dst = check_row_pair(self._geometry, "swap_request_rows", src_idxs, dst_idxs)
        rows = self._geometry.max_requests  # a row twice would move one annotation twice
        refuse_repeated_rows("swap_request_rows", src, rows, "src_idxs")
        refuse_repeated_rows("swap_request_rows", dst, rows, "dst_idxs")
        scratch = self._scratch
        if 2 * len(src) > len(scratch):
            scratch = np.empty(2 * len(src), dtype=np.int32)
        bad = _swap_rows(annotations, src, dst, scratch)
        if bad >= 0:  # refused before any write
            raise_refused_row_pair(self._geometry, src, dst, bad)
        self._state.committed = None
