"""``CommitStage``: a commit pass's fixed shadow on the forward ring (``stages``).

A pass of ``T`` real tokens padded to ``t``, ``r`` request slots, ``m`` staged lengths
and ``d`` device rows places: block and local offset ``[:t]``; request, position and
pos id ``[:T]`` (pad tokens' stay as they were); lengths ``[:r]``, their sums
``[:r + 1]``; table rows ``[:d]`` from the private reuse table (the rows the draft
loop's ``begin_decode`` landed) and ``[d:r]`` from the shadow; the persistent query
lengths ``[:m]``. The table rows sit last, so the H2D copy ends at the rows the pass
writes.

``T`` is new at almost every step; the prefixes of its three real-token roles are
built on first use (``stages``): the sources' once per ring for every view, the view's
own per view, so a new view's first pass builds only its own counts' views (building
all 4,096 ahead would cost 65-95 ms per view).

With block counts (``counted``), ``flush_counted`` ships packed ``[m, C]`` rows into
the slot's own device stage, completes whole rows from device blocks of one value,
and lays the packed rows over ``[:m, :C]`` with one strided copy.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from torch import Tensor

from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.gpu_view import ViewFields, ViewTarget, view_entries
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.prefixes import Prefixes
from mtpmeta.mirror.stages import (ALIGN, LENGTHS, PAD_ROWS, PADDED, REAL_ROLES,
                                   REAL_ROWS, SUMMED, SUMS, TABLE, COMMON, FixedStage,
                                   copy_mode, shared_prefixes)

__all__ = ["CommitStage"]
# Memory order: request fields, token fields, then the table rows the H2D copy ends in.
_ORDER = LENGTHS + SUMS + REAL_ROWS + PAD_ROWS + (TABLE,)
# The roles by the length they are placed over: padded tokens, real tokens, request
# slots (lengths), slots + 1 (sums), device rows, staged lengths.
_CLASSES = ((0, 1), REAL_ROLES, (PADDED, PADDED + 1), (SUMMED, SUMMED + 1),
            (len(COMMON),), (len(COMMON) + 1,))


class CommitStage(FixedStage):
    """A commit pass's fixed shadow: the request fields at ``requests`` rows (``+ 1``
    for the sums), then the token fields at ``cap`` tokens, then ``requests`` table
    rows, last, so the H2D copy ends at the table rows the pass writes.

    Per slot it keeps what a counted pass last wrote in the slot's table region:
    ``known[slot]`` ``[requests + 1]`` int32, each row's count, for the leading
    ``known_rows[slot]`` rows, valid while the ring's mark of the slot is
    ``packed_mark(C, fill)`` (``StagingRing.acquire``)."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, cap: int,
                 requests: int, device_table: Tensor) -> None:
        table = target.fields.mha_block_table
        super().__init__(target, ring, buffers, self._entries(target, cap, requests),
                         cap, {"table": (table, device_table),
                               "query_lengths": (buffers.query_lengths, LENGTHS[0])},
                         _CLASSES)
        self.requests = requests
        self._whole_rows: Dict[Tuple[int, int], Tuple[Tensor, Tensor, int]] = {}
        words, group = copy_mode(table,
                                 self.layout.tensors(ring.device_slots[0]).mha_block_table)
        self._rows_view = Prefixes(table, words, self._counter)
        self._rows_src = shared_prefixes(ring, self._zone.mha_block_table, words, True)
        self._table_field = table  # the view's mha_block_table [R, W]
        self._counted_groups: List[int] = []  # distinct groups of flush_counted rows
        # (slot, C) -> (the view's mha_block_table[:, :C], the slot's staged table
        # region as [rows, C]): a packed pass's strided copy, row prefixes of these.
        self._packed_pairs: Dict[Tuple[int, int], Tuple[Tensor, Tensor]] = {}
        # A counted pass's packed rows per slot (class docstring): each row's count
        # (the columns from it on hold the fill) and how many leading rows that holds
        # for, valid while the ring's mark for the slot is packed_mark(C, fill).
        self.known = [np.zeros(requests + 1, dtype=np.int32) for _ in range(ring.num_slots)]
        self.known_rows = [0] * ring.num_slots
        self._rows_words = words
        self._rows_group = self._group(group)
        self._seal()

    @classmethod
    def fitting(cls, target: ViewTarget, ring: Any, buffers: Any, max_requests: int,
                device_table: Tensor) -> Optional["CommitStage"]:
        """The stage at ``min(R, view max_requests)`` request rows and the view's
        max_tokens, or as many tokens (at least ``R``) as one of ``ring``'s slots then
        holds; None when not even ``R`` tokens fit. Sized from its layout alone, as its
        fields are views over the ring's zone (one slot's bytes). ``device_table``
        ``[R, W]``: the private reuse table a pass's leading rows are placed from."""
        requests = min(max_requests, target.max_requests)
        def layout(cap: int) -> PackedLayout:
            return PackedLayout.build(cls._entries(target, cap, requests), align=ALIGN)
        cap = target.max_tokens
        if layout(cap).nbytes > ring.slot_bytes:
            bare = layout(0)
            per_token = sum(dtype.itemsize for name, dtype in zip(bare.names, bare.dtypes)
                            if name in PAD_ROWS + REAL_ROWS)
            cap = (ring.slot_bytes - bare.nbytes - ALIGN * 5) // per_token
            if cap < max_requests or layout(cap).nbytes > ring.slot_bytes:
                return None
        return cls(target, ring, buffers, cap, requests, device_table)

    @staticmethod
    def _entries(target: ViewTarget, cap: int, requests: int) -> tuple:
        """The stage's ``(name, dtype, shape)`` entries in memory order (``_ORDER``) at
        ``requests`` rows and ``cap`` tokens, in the dtypes of ``target``'s view."""
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {e[0]: e for e in view_entries(requests, cap, target.width, dtypes)}
        return tuple(by_name[name] for name in _ORDER)

    def flush(self, slot: int, tokens: int, real_tokens: int, requests: int,
              staged_count: int, device_rows: int) -> None:
        """Ship and place a commit pass: table rows ``[:device_rows]`` from the
        stage's ``device_table``, ``[device_rows:requests]`` from the shadow. The
        caller entered the backend's ``StreamOrder`` first and records the slot's
        fence after."""
        shadow_rows = requests - device_rows
        shipped = self._ship(slot, shadow_rows)
        extra = []
        if shadow_rows:
            source = self._rows_src
            src = source.cache.get(shadow_rows)
            if src is None:
                src = source.build(shadow_rows)
            extra.append((self._rows_view.rows(device_rows, requests), src,
                          self._rows_group))
        self._place_lengths(shipped, (tokens, real_tokens, requests, requests + 1,
                                      device_rows, staged_count), extra)

    def flush_counted(self, slot: int, tokens: int, real_tokens: int, requests: int,
                      staged_count: int, columns: int,
                      wholes: List[Tuple[Tensor, int, int]]) -> None:
        """Ship and place a commit pass with packed rows (``counted``): the
        shadow's table region holds the packed ``[staged_count, columns]`` rows;
        ``wholes``, ``(device block of one value, start, stop)`` row ranges (the
        caller's: its fill past the counts, the pad rows' -1), join the grouped copy
        as whole rows, then one strided copy lays the packed rows over
        ``[:staged_count, :columns]``. The caller records the slot's fence after."""
        last = len(self.layout.names) - 1
        width = self.layout.shapes[last][1]
        shipped = self._ship(slot, 0, packed_bytes=staged_count * columns
                             * self.layout.dtypes[last].itemsize)
        extra = [self._whole(block, start, stop, width) for block, start, stop in wholes
                 if stop > start]
        self._place_lengths(shipped, (tokens, real_tokens, requests, requests + 1, 0,
                                      staged_count), extra)
        if staged_count:
            pair = self._packed_pairs.get((slot, columns))
            if pair is None:  # the view's first C columns, the slot's region as C-rows
                flat = self.layout.tensors(self.ring.device_slots[slot]) \
                    .mha_block_table.view(-1)
                rows = flat.shape[0] // columns
                pair = (self._table_field[:, :columns],
                        flat[:rows * columns].view(rows, columns))
                self._packed_pairs[(slot, columns)] = pair
                self._counter[0] += 1
            pair[0][:staged_count].copy_(pair[1][:staged_count], non_blocking=True)

    def _extra_groups(self) -> List[int]:
        return [self._rows_group] + self._counted_groups

    def packed_mark(self, columns: int, fill: int) -> tuple:
        """The ring mark of a slot whose table region (from ``_end_base`` on) holds
        this stage's packed rows at ``columns`` columns, ``fill`` past their counts."""
        return (self._end_base, self, columns, fill)

    def _whole(self, block: Tensor, start: int, stop: int,
               width: int) -> Tuple[Tensor, Tensor, int]:
        """``(view rows [start:stop], the block's first rows, group)``: whole rows from
        a device block of one value, cached by ``(start, stop)`` and the block."""
        key = (start, stop, block.data_ptr())
        pair = self._whole_rows.get(key)
        if pair is None:
            dst = self._table_field[start:stop]
            src = block[:(stop - start) * width].view(stop - start, width)
            words, group = copy_mode(dst, src)
            if words:
                dst, src = word_view(dst), word_view(src)
            pair = (dst, src, self._group(group))
            if pair[2] not in self._counted_groups:
                self._counted_groups.append(pair[2])
            self._whole_rows[key] = pair
            self._counter[0] += 1
            self._seal()
        return pair
