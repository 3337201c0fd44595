"""``BeginStaging``: a host-route ``begin_decode``'s pinned slots, its device landing,
and the reuse of the landed rows by a commit pass.

A begin stages the draft head (the device count ``n``, then the offsets, laid out as
``buffers.draft_head``) and the block table rows in a pinned slot (``stage``, the plan
step: the kernel writes the slot, which then is the draft loop's host truth), then
issues two data ops (``ship``, the run step): one H2D copy of the head and the leading
rows, ``n`` rounded up to ``BEGIN_ROWS``, into the private landing, and one
``_foreach_copy_`` of ``draft_head[:n + 1]`` and ``block_table[:n]`` from it (both as
int32 words; two copies when their words differ). So the views it keeps are per slot
and bucket of rows, and per ``n``, never per (slot, n).

Table reuse: the landing's table part is ``reuse_table``, a private device copy that
no public name aliases, so no write into the persistent buffers (in place, ``.data``,
DLPack, a graph replay, under ``torch.inference_mode``) can reach a row a commit pass
places from it. A commit pass takes the longest prefix of its ``[:min(P, n)]`` rows
equal to the rows the draft loop staged (``reusable_rows``: compared on the host
against the host truth; the rest are copied, so each row is compared or copied, one
pass per table). A step whose commit pass follows its draft loop on one table ships
that table once, not twice.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers import persistent
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.device_runtime import DeviceRuntime
from mtpmeta.buffers.layout import PackedLayout, dtype_range
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.kernels import native
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.pinned_ring import StagingRing
from mtpmeta.mirror.stages import ALIGN

__all__ = ["BeginStaging", "BEGIN_ROWS"]

#: A host-route begin ships its table rows rounded up to this many (module docstring).
BEGIN_ROWS = 8


class BeginStaging:
    """The begin ring and its device landing.

    ``ring``: ``num_slots`` pinned slots, each a ``head`` ``[R + 1]`` int32 then a
    ``block_table`` ``[R, W]`` of the table dtype; ``arrays[slot]`` /
    ``tensors[slot]``: those fields as numpy arrays / host tensors. ``landing``: the
    same layout on the device, aliased by no public name: ``landing_head`` ``[R + 1]``
    int32 and ``reuse_table`` ``[R, W]``. A counted begin (``counted``) uses the slots'
    table regions and ``reuse_table``'s storage for packed ``[n, C]`` rows; it marks
    the slot (``StagingRing.marks``), and a plain ``stage`` drops the mark.

    Invariant: ``reuse_table[:device_rows]`` equals the host truth's rows
    ``[:device_rows]`` once the ops issued so far ran (``ship`` and
    ``hold_dummy_rows`` set it, a route that lands anything else there sets 0); rows
    past it are never read.
    """

    def __init__(self, buffers: PersistentBuffers, runtime: DeviceRuntime, *,
                 max_requests: int, block_size: int, dummy: int, num_slots: int) -> None:
        self.buffers = buffers
        self.runtime = runtime
        self.max_requests = max_requests
        self.block_size = block_size
        device = buffers.offsets.device
        width = buffers.block_table.shape[1]
        layout = PackedLayout.build((("head", torch.int32, (max_requests + 1,)),
                                     ("block_table", buffers.block_table.dtype,
                                      (max_requests, width))), align=ALIGN)
        self.ring = StagingRing(layout.nbytes, num_slots, device, runtime)
        self.arrays = [layout.arrays(self.ring.host_np[i]) for i in range(num_slots)]
        self.tensors = [layout.tensors(self.ring.slots[i]) for i in range(num_slots)]
        self.landing = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.landing_head, self.reuse_table = layout.tensors(self.landing)
        self.reuse_table.fill_(dummy)
        self.dummy = dummy
        self.device_rows = 0
        self.table_range = dtype_range(self.reuse_table.dtype)  # the ids it holds
        self.table_at = layout.offsets[1]  # bytes before a slot's table rows
        self._row_bytes = width * self.reuse_table.element_size()
        self._table_words = word_view(buffers.block_table)
        self._reuse_words = word_view(self.reuse_table)
        # Views by a name (a slot's at most) and a count <= R + 1: never evicted.
        self.views = BoundedCache(64 * (max_requests + 2))
        # Every n's placement pairs: a draft loop of a new n builds none.
        for count in range(max_requests + 1):
            self.views.put(("begin_place", count), self._pairs(count))

    def stage(self, count: int, start_positions: np.ndarray, table_src: np.ndarray,
              host_offsets: np.ndarray) -> Tuple[int, np.ndarray]:
        """Take a slot and write the head (``n``, then the offsets) and whole table rows
        ``[:n]`` there (start positions already checked); ``host_offsets[:n]`` takes
        the offsets. Returns ``(slot, the slot's [R, W] table)``: the host truth of the
        draft loop until a later begin takes the slot."""
        slot = self.ring.acquire()
        staged = self.arrays[slot]
        head_np, table_np = staged.head, staged.block_table
        native.draft_state.copy_decode_inputs(start_positions, table_src, count,
                                              self.block_size, head_np[1:], table_np)
        # The device count too, in the same copy: a graph captured with capture_setup
        # (contract §12) replayed after this begin masks rows [n, padded) as pad rows.
        persistent.stage_count(head_np, count)
        host_offsets[:count] = head_np[1:count + 1]
        return slot, table_np

    def ship(self, slot: int, count: int) -> None:
        """Two data ops (module docstring): the slot's head and leading rows into the
        landing, then ``draft_head[:n + 1]`` and ``block_table[:n]`` from it; releases
        the slot. Rows past ``count`` land past ``device_rows`` and are never read."""
        rows = min(-(-count // BEGIN_ROWS) * BEGIN_ROWS, self.max_requests)
        land, source = self.views.get_or_build(("begin_h2d", slot, rows),
                                               lambda: self._h2d(slot, rows))
        land.copy_(source, non_blocking=True)
        dsts, srcs, grouped = self.views.get_or_build(("begin_place", count),
                                                      lambda: self._pairs(count))
        if grouped:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        else:  # no rows, or words that differ (a table dtype of other than 4 or 8 bytes)
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)
        self.ring.release(slot)
        self.device_rows = count

    def _h2d(self, slot: int, rows: int) -> Tuple[Tensor, Tensor]:
        end = self.table_at + rows * self._row_bytes
        return self.landing[:end], self.ring.slots[slot][:end]

    def _pairs(self, count: int) -> Tuple[List[Tensor], List[Tensor], bool]:
        """``([draft_head[:n + 1], block_table[:n]], [their landing rows], grouped)``,
        the table's pair as int32 words (``word_view``; none for ``count`` 0);
        ``grouped``: two pairs of one dtype, one ``_foreach_copy_``."""
        dsts = [self.buffers.draft_head[:count + 1]]
        srcs = [self.landing_head[:count + 1]]
        if count:
            dsts.append(self._table_words[:count])
            srcs.append(self._reuse_words[:count])
        grouped = len(dsts) > 1 and len({t.dtype for t in dsts + srcs}) == 1
        return dsts, srcs, grouped

    def drop_rows(self) -> None:
        """The landing holds no row a commit pass may take (a counted begin landed
        packed rows there, or a device-route begin staged a table the host never saw)."""
        self.device_rows = 0

    def hold_dummy_rows(self, count: int) -> None:
        """``reuse_table[:count]`` takes the dummy block, as a capture begin's host
        truth holds it (one device op); those rows are then reusable."""
        self._reuse_rows(count).fill_(self.dummy)
        self.device_rows = count

    def _reuse_rows(self, count: int) -> Tensor:
        """``reuse_table[:count]``, built once per ``count``."""
        return self.views.get_or_build(("reuse_table", count),
                                       lambda: self.reuse_table[:count])

    def land_rows(self, table: Tensor, num_prefill: int, pad_tokens: int) -> int:
        """How many leading rows of a commit pass to place from ``reuse_table``, after
        copying them there from the caller's device copy ``table`` [>= P, W] of its
        host rows (one device op; by the caller's contract the rows are equal, and
        the caller made sure ``table_range`` holds every id the view does). ``table``
        is ``record_stream``-ed on the current stream, so its producer may free it at
        once from any stream. The row that absorbs a full batch's pad is cut back by
        the kernel and never taken. The landing then holds no begin's rows
        (``device_rows`` 0)."""
        rows = num_prefill - 1 if pad_tokens > 0 and num_prefill == self.max_requests \
            else num_prefill
        self.device_rows = 0
        if rows:
            self._reuse_rows(rows).copy_(table if table.shape[0] == rows else table[:rows],
                                         non_blocking=True)
            self.runtime.record_stream(table, self.reuse_table.device)
        return rows

    def reusable_rows(self, table: np.ndarray, num_prefill: int, pad_tokens: int,
                      host_table: np.ndarray) -> int:
        """How many leading rows of a commit pass's ``table`` [>= P, W] to place from
        ``reuse_table`` instead of the shadow: the longest prefix of the first
        ``min(P, device_rows)`` rows that equals ``host_table``, the host truth of
        what the device holds (``matching_rows``: compared, never assumed). The kernel
        copies the rows after it, so each row is compared or copied: one pass over the
        table. The row that absorbs a full batch's pad is cut back by the kernel and
        never taken."""
        rows = min(num_prefill, self.device_rows)
        if pad_tokens > 0 and num_prefill == self.max_requests:
            rows = min(rows, num_prefill - 1)
        if rows <= 0:
            return 0
        return native.draft_state.matching_rows(table, host_table, rows)
