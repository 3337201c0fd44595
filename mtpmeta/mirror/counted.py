"""``CountedRoute``: the mirror path's begin and commit pass with block counts (the
opt-in counts, ``mtpmeta.validation.block_counts``, or counts derived from a wide
table), which read and ship only the used columns of their table.

``C = column_bucket(max count, W)`` (a power-of-two multiple of 8, capped at ``W``):
the rows cross to the device as one contiguous ``[rows, C]`` block, so the host cost
follows the blocks in use, not ``W``; the columns ``[C, W)`` of the device rows get the
dummy block ``D`` on the device. On a table narrower than ``DERIVED_MIN_WIDTH``
columns ``C`` is ``W`` (``shipped_columns``): whole rows cost a few bytes more and
save the device ops that complete packed rows. No state grows per shape: a begin
keeps its views per ``(slot, C)`` (``_packed_views``) and a commit its strided copy
(``C`` takes at most ``ceil(log2(W / 8)) + 1`` values), each taking its first rows per
call, and a commit ships a bucketed end (``CommitStage._packed_end``).

* begin: the pinned begin slot's table region holds the packed ``[n, C]`` rows; one
  H2D copy lands them in the private ``reuse_table``'s storage (as a flat scratch),
  one device copy places them in ``block_table[:n, :C]`` and one fill writes ``D`` over
  ``[:n, C:]``: 4 data ops with the head's H2D, two more than without counts (at
  ``C = W`` the rows are ``block_table[:n]``'s layout and land there: 2). The
  packed rows are the draft loop's host truth (``host_block_table``, ``[n, C]``: the
  used entries, ``D`` up to ``C``; the columns past ``C`` hold ``D`` by definition),
  kept so at O(used) cost by per-slot widths (``stage_counted_inputs``:
  each row's last count, valid while the begin ring's mark of the slot names this
  route at the same ``C`` and fill; a plain begin, which writes the slot at width
  ``W``, drops the mark). ``reuse_table`` then holds no rows a commit may take
  (``BeginStaging.drop_rows``).
* commit: no row is reused from the device; the commit stage's table region holds the
  packed ``[m, C]`` rows (``m`` the staged requests), shipped with the rest of the
  shadow; the one ``_foreach_copy_`` also writes whole rows ``[:m]`` from a device
  block of ``D`` and the pad rows from the block of -1, and one strided device copy then
  lays the packed rows over ``[:m, :C]``: 3 data ops, one more than without counts.
  At ``C = W`` the rows are whole (``D`` past the counts, -1 pad rows written on the
  host) and ship and land with the rest of the pass, as without counts: 2 data ops.
  A pass that does not fit the fixed commit stage ships whole rows (``D`` past the
  counts) through the per-shape shadow.

Derived counts (the default route, no counts passed): a begin or commit pass whose
table has at least ``DERIVED_MIN_ENTRIES`` entries (``n * W``, ``P * W``) and at
least ``DERIVED_MIN_WIDTH`` columns (``derives``) takes
each row's count from the table itself, the columns before its trailing run of -1
(``native.draft_state.used_columns``: one read of the rows, at read bandwidth), so the
host writes only those columns, not whole rows; the device table and the view stay the
caller's bit for bit.

* begin: the counted begin with -1, not ``D``, past the counts: packed ``[n, C]``
  rows (``C`` the bucket of the largest used count) are the host truth and the only
  table bytes that cross (a quarter of whole rows' at production: about 1.3 against
  5.3 MB per step), placed in ``block_table[:n, :C]`` with -1 over ``[:n, C:]``: 4
  device data ops (2 at ``C = W``, whose rows land in place), no row reused by the
  commit pass. A depth whose row writes a column at or past ``C`` holds -1 there, as
  the caller's table does, and is refused as on whole rows, in row order
  (``checks.check_draft_blocks``).
* commit: the counted pass with -1, not ``D``, past the counts: packed ``[m, C]``
  rows, whole rows of -1 from the device block of -1 (of ``D`` for the pad request),
  3 data ops; no row is reused from the device. A token that writes a -1 column is
  refused as on whole rows (the pass's checks read the caller's table).

Rows that use most of the width are written the same way (``C`` may reach ``W``):
their read is done, and no write exceeds a copy's. A commit pass takes the whole-row
route instead, before any read, for a full batch whose last request absorbs the pad
(its cut puts ``D`` past ``C``) and for a pass no fixed stage fits.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers import persistent
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.grad_mode import kept_tensors
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels import native
from mtpmeta.kernels.counted import column_bucket, counted_commit, first_row_past_packed
from mtpmeta.mirror.begin_staging import BeginStaging
from mtpmeta.mirror.commit_stage import CommitStage
from mtpmeta.mirror.forward_staging import ForwardStaging

__all__ = ["CountedRoute", "DERIVED_MIN_ENTRIES", "DERIVED_MIN_WIDTH", "derives",
           "packed_refusal"]

_min_max = native.checks.min_max

#: A default begin or commit pass of at least this many table entries (n W, P W) on a
#: table of at least this many columns takes the derived counts (module docstring;
#: measured in BENCHMARKS.md: below either, the whole-row route is as fast or faster).
DERIVED_MIN_ENTRIES = 1 << 16
DERIVED_MIN_WIDTH = 256


def derives(entries: int, width: int) -> bool:
    """Whether a default call over ``entries`` table entries of ``width`` columns takes
    the derived counts (the two thresholds above, read at each call)."""
    return entries >= DERIVED_MIN_ENTRIES and width >= DERIVED_MIN_WIDTH


def shipped_columns(block_counts: np.ndarray, count: int, width: int,
                    largest: Optional[int] = None) -> int:
    """The columns ``C`` a counted call ships of its first ``count`` rows: ``W`` on a
    table narrower than ``DERIVED_MIN_WIDTH`` (whole rows cost fewer device ops than
    packed ones completed on the device, for a few bytes more), else the bucket of the
    largest count (``largest`` when the caller knows it)."""
    if width < DERIVED_MIN_WIDTH:
        return width
    if largest is None:
        largest = int(_min_max(block_counts, count)[1])
    return column_bucket(largest, width)


def packed_refusal(status: int, host_offsets: np.ndarray, host_table: np.ndarray,
                   count: int, block_size: int, width: int) -> int:
    """A depth's refusal ``status`` (``decode_step_maps``'s, offsets already in
    ``[0, W)``) as it is on a ``W``-wide table when the host truth ``host_table`` is a
    counted begin's ``[n, C]`` rows: the kernel skips (-1) a row whose column lies in
    ``[C, W)``, which is past its count, so the first such row comes first."""
    columns = host_table.shape[1]
    if columns == width:
        return status
    row = first_row_past_packed(host_offsets, count, block_size, columns,
                                -1 if status == -1 else -2 - status)
    return status if row < 0 else -2 - row


class CountedRoute:
    """The begin and commit pass with counts, on the begin ring (``BeginStaging``) and
    the forward ring's commit stages (``ForwardStaging``) that the backend also holds.

    Holds ``counts`` ``[R]`` int32, the counts of the last counted begin (the host
    truth's per-row counts after one); per begin slot, the count of each row its
    packed rows were last written with (``[R]`` int32), valid for the leading
    ``_known_rows[slot]`` rows while the begin ring's mark of the slot is
    ``(table offset, this route, C, fill)``; the ``(slot, C)`` views of a counted
    begin; and ``[R * W]`` int32 of ``D`` on the device, allocated at the first
    counted commit pass that needs whole rows of it, never in a draft loop.
    """

    def __init__(self, buffers: PersistentBuffers, begin: BeginStaging,
                 forward: ForwardStaging, *, max_requests: int, block_size: int,
                 dummy: int) -> None:
        self.buffers = buffers
        self._begin = begin
        self._forward = forward
        self.max_requests = max_requests
        self.block_size = block_size
        self.dummy = dummy
        self._width = buffers.block_table.shape[1]
        self.counts = np.zeros(max_requests, dtype=np.int32)
        self._commit_used = np.zeros(max_requests + 1, dtype=np.int32)  # derived, [R + 1]
        self._lengths = np.zeros(max_requests + 1, dtype=np.int32)  # kernel scratch
        self._dummy_rows: Optional[Tensor] = None  # [R * W] int32 of D, lazily
        self._packed_view_cache: dict = {}  # (begin slot, C) -> _packed_views
        slots = begin.ring.num_slots
        self._known_rows = [0] * slots
        self._widths = [np.zeros(max_requests, dtype=np.int32) for _ in range(slots)]
        # Head views by a name and a count <= R + 1 (a slot's at most): never evicted.
        self._views = BoundedCache(64 * (max_requests + 2))

    # ---------------------------------------------------------------------- begin
    def begin(self, count: int, start_positions: np.ndarray, table_src: np.ndarray,
              block_counts: np.ndarray, host_offsets: np.ndarray,
              fill: Optional[int] = None, largest: Optional[int] = None) -> np.ndarray:
        """The begin with counts (start positions already checked; module docstring):
        ``host_offsets[:n]`` and ``counts[:n]`` take the offsets and counts; returns
        the packed ``[n, C]`` rows, the draft loop's host truth. ``fill``: the rows'
        value past their counts (``D``; -1 for derived counts, which are the caller's
        table); ``largest``: the largest count when the caller knows it."""
        fill = self.dummy if fill is None else fill
        columns = shipped_columns(block_counts, count, self._width, largest)
        slot, packed = self._stage_packed(count, start_positions, table_src, block_counts,
                                          columns, fill, host_offsets)
        self._ship_packed(slot, count, columns, fill)
        return packed

    def begin_derived(self, count: int, start_positions: np.ndarray,
                      table_src: np.ndarray, host_offsets: np.ndarray) -> np.ndarray:
        """The default begin of a wide table (module docstring, "Derived counts"): the
        counted begin with each row's used columns as its count and -1 past them, so
        the device table is the caller's bit for bit and only ``[n, C]`` rows cross."""
        used = self.counts
        largest = native.draft_state.used_columns(table_src, count, used)
        return self.begin(count, start_positions, table_src, used, host_offsets, -1,
                          int(largest))

    def _ship_packed(self, slot: int, count: int, columns: int, fill: int) -> None:
        """The device side of a counted begin staged in ``slot`` (module docstring): the
        head's H2D copy into ``draft_head[:n + 1]``, then the packed rows into
        ``block_table[:n, :C]`` (through the landing when ``C < W``, ``fill`` over
        ``[:n, C:]``); releases the slot. The landing then holds no reusable rows."""
        begin = self._begin
        self._views.prefix("draft_head", self.buffers.draft_head, count + 1).copy_(
            self._views.prefix(("begin_head", slot), begin.tensors[slot].head, count + 1),
            non_blocking=True)
        if count:
            staged, landing, first_columns, past_columns = self._packed_views(slot, columns)
            if past_columns is None:  # C = W: the packed rows are block_table's layout
                first_columns[:count].copy_(staged[:count], non_blocking=True)
            else:  # a strided destination: land contiguous, then place
                landing = landing[:count]
                landing.copy_(staged[:count], non_blocking=True)
                first_columns[:count].copy_(landing)
                past_columns[:count].fill_(fill)
        begin.ring.release(slot)
        begin.drop_rows()  # reuse_table holds packed rows, not [R, W] ones

    def _packed_views(self, slot: int, columns: int) -> tuple:
        """``[R, C]`` views of a counted begin at ``C = columns``: begin ``slot``'s
        pinned table region and the ``reuse_table`` landing, both as contiguous
        ``C``-rows, and ``block_table[:, :C]`` and ``[:, C:]`` (None when ``C`` is
        ``W``); the caller takes their first ``n`` rows. Built once per ``(slot, C)``
        (at most ``slots * (ceil(log2(W / 8)) + 1)`` entries, whatever the shapes)."""
        key = (slot, columns)
        views = self._packed_view_cache.get(key)
        if views is None:
            rows, width = self.buffers.block_table.shape
            entries = rows * columns
            table = self.buffers.block_table
            views = self._packed_view_cache[key] = (
                self._begin.tensors[slot].block_table.view(-1)[:entries].view(rows, columns),
                self._begin.reuse_table.view(-1)[:entries].view(rows, columns),
                table[:, :columns], table[:, columns:] if columns < width else None)
        return views

    def _stage_packed(self, count: int, start_positions: np.ndarray,
                      table_src: np.ndarray, block_counts: np.ndarray, columns: int,
                      fill: int, host_offsets: np.ndarray) -> Tuple[int, np.ndarray]:
        """Take a begin slot and write its head and packed ``[n, C]`` rows (``fill``
        from each row's count to ``C``) with ``stage_counted_inputs``: each row's used
        columns, and only where the slot's last rows may differ when this route wrote
        them at the same ``(C, fill)`` (the ring's mark); ``counts`` takes the counts.
        Returns ``(slot, packed rows)``; the caller releases the slot once its copies
        are issued."""
        begin = self._begin
        ring = begin.ring
        slot = ring.acquire()
        staged = begin.arrays[slot]
        head_np = staged.head
        packed = staged.block_table.reshape(-1)[:count * columns].reshape(count, columns)
        mark = (begin.table_at, self, columns, fill)
        known = self._known_rows[slot] if ring.last_mark == mark else 0
        native.draft_state.stage_counted_inputs(
            start_positions, table_src, block_counts, count, self.block_size, fill,
            self._width, head_np[1:], packed, self._widths[slot], known, self.counts)
        ring.marks[slot] = mark
        self._known_rows[slot] = max(known, count)
        persistent.stage_count(head_np, count)
        host_offsets[:count] = head_np[1:count + 1]
        return slot, packed

    # --------------------------------------------------------------------- commit
    def commit(self, target: ViewTarget, counts: np.ndarray, starts: Optional[np.ndarray],
               table: np.ndarray, inherited: Optional[np.ndarray],
               block_counts: np.ndarray, padded_tokens: int, pad_tokens: int,
               min_padded_requests: int, padded_requests: int
               ) -> Tuple[int, int, int, int]:
        """The commit pass with counts; module docstring. Returns as ``commit_pass``."""
        forward = self._forward
        stage = forward.commit_stage(target)
        if stage is None or padded_tokens > stage.cap or padded_requests > stage.requests:
            slot, layout, token_args, request_args = forward.shadow(
                target, padded_tokens, padded_requests, padded_requests)
            result = self._kernel(counts, starts, table, inherited, block_counts,
                                  padded_tokens, pad_tokens, min_padded_requests, target,
                                  token_args, request_args,
                                  np.zeros(padded_requests + 1, np.int32), 0)
            if result[0] < 0:
                forward.ring.release(slot)
                return result
            forward.flush(target, slot, layout, padded_tokens, result[0], result[2],
                          "query", result[1], 0, reused=True)
            return result
        columns = shipped_columns(block_counts, counts.shape[0], target.width)
        return self._commit_packed(stage, target, counts, starts, table, inherited,
                                   block_counts, columns, self.dummy, padded_tokens,
                                   pad_tokens, min_padded_requests, padded_requests)

    def commit_derived(self, target: ViewTarget, counts: np.ndarray,
                       starts: Optional[np.ndarray], table: np.ndarray,
                       inherited: Optional[np.ndarray], padded_tokens: int,
                       pad_tokens: int, min_padded_requests: int, padded_requests: int
                       ) -> Optional[Tuple[int, int, int, int]]:
        """The default commit pass of a wide table, packed (module docstring, "Derived
        counts"), at ``C`` up to ``W`` (rows that use most of the width then cross whole,
        the table still read once); None, with nothing staged, when no fixed stage fits
        or when a full batch's last request absorbs the pad (its cut puts ``D`` past
        ``C``)."""
        stage = self._forward.commit_stage(target)
        num_prefill = counts.shape[0]
        if stage is None or padded_tokens > stage.cap or \
                padded_requests > stage.requests or \
                (pad_tokens > 0 and num_prefill >= self.max_requests):
            return None
        used = self._commit_used
        columns = column_bucket(native.draft_state.used_columns(table, num_prefill, used),
                                target.width)
        return self._commit_packed(stage, target, counts, starts, table, inherited, used,
                                   columns, -1, padded_tokens, pad_tokens,
                                   min_padded_requests, padded_requests)

    def _commit_packed(self, stage: CommitStage, target: ViewTarget, counts: np.ndarray,
                       starts: Optional[np.ndarray], table: np.ndarray,
                       inherited: Optional[np.ndarray], block_counts: np.ndarray,
                       columns: int, fill: int, padded_tokens: int, pad_tokens: int,
                       min_padded_requests: int, padded_requests: int
                       ) -> Tuple[int, int, int, int]:
        """A commit pass on the fixed ``stage`` whose rows ship packed at ``columns``
        columns, ``fill`` past ``block_counts``; whole rows of ``fill`` (of ``D`` for the
        pad request) and -1 (the pad rows) complete them on the device. At ``C = W``
        the kernel writes whole rows, the pad rows' included, and the pass ships as a
        pass without counts does (``CommitStage.flush``)."""
        ring = self._forward.ring
        slot = ring.acquire()
        token_args, request_args = stage.args(slot)
        packed = request_args[4].reshape(-1)[:padded_requests * columns].reshape(
            padded_requests, columns)
        # The slot's packed rows are known when this stage, at this C and fill, wrote
        # them last.
        mark = stage.packed_mark(columns, fill)
        known_rows = stage.known_rows[slot] if ring.last_mark == mark else 0
        result = self._kernel(counts, starts, table, inherited, block_counts,
                              padded_tokens, pad_tokens, min_padded_requests, target,
                              token_args, request_args[:4] + (packed,), stage.known[slot],
                              known_rows, fill)
        ring.marks[slot] = mark  # refused or not, the kernel wrote by the bookkeeping
        stage.known_rows[slot] = max(known_rows, padded_requests) if result[0] >= 0 \
            else known_rows
        if result[0] < 0:
            ring.release(slot)
            return result
        total, staged, padded_requests, _ = result
        if columns == target.width:  # whole rows, the pad rows' -1 among them
            stage.flush(slot, padded_tokens, total, padded_requests, staged, 0)
            ring.release(slot)
            return result
        num_prefill = counts.shape[0]
        minus_one = self._forward.minus_one
        # C < W here: whole rows of the fill complete the packed ones past C.
        if fill == self.dummy:
            wholes = [(self._dummy_block(), 0, staged)]
        else:
            wholes = [(minus_one, 0, min(num_prefill, staged))]
            if staged > num_prefill:
                wholes.append((self._dummy_block(), num_prefill, staged))
        wholes.append((minus_one, staged, padded_requests))
        stage.flush_counted(slot, padded_tokens, total, padded_requests, staged, columns,
                            wholes)
        ring.release(slot)
        return result

    def _kernel(self, counts, starts, table, inherited, block_counts, padded_tokens,
                pad_tokens, min_padded_requests, target, token_args, request_args, known,
                known_rows, fill=None):
        return counted_commit(
            counts, starts, table, inherited, block_counts, padded_tokens, pad_tokens,
            self.max_requests, min_padded_requests, self.block_size, self.dummy,
            self._width, target.token_block_range[1], self._lengths, token_args,
            request_args, known, known_rows, fill)

    def _dummy_block(self) -> Tensor:
        """``[R * W]`` int32 of ``D`` on the device, the source of a counted commit's
        whole rows (allocated at the first counted commit pass, never in a draft loop)."""
        block = self._dummy_rows
        if block is None:
            minus_one = self._forward.minus_one
            with kept_tensors():
                block = torch.full(minus_one.shape, self.dummy, dtype=torch.int32,
                                   device=minus_one.device)
            self._dummy_rows = block
        return block
