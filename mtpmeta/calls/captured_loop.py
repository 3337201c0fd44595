"""``MTPMetadata``'s entry points into the captured draft loop (contract §12).

A mixin of ``MTPMetadata``: the public methods (``begin_decode``,
``begin_decode_for_capture``, ``setup_decode_step``, ``advance_decode_step``,
``stage_decode_lengths``) validate as always and hand a loop begun with
``capture_setup=True`` to these methods, which drive ``CapturedRoute``
(``mtpmeta.mirror.captured_route``). Two flags of the object: ``_capture_setup`` (this draft loop
takes the captured route; set by a ``capture_setup=True`` begin, cleared by any other
begin and by ``end_forward``) and ``_offsets_stale`` (set by every ``capture_setup``
begin, cleared by any other begin: a graph replay may advance the offsets with no host
code, so from that begin on the host copy of the offsets is not the truth).

Graphs and allocations: a graph holds the addresses of the buffers it was captured on.
``_capture_counts`` holds the padded counts ``begin_decode_for_capture(p,
capture_setup=True)`` prepared on this allocation, ``_orphaned_counts`` those prepared
on an earlier one only: a ``capture_setup`` begin at such a count is refused (its graph
would replay against freed buffers) until ``begin_decode_for_capture`` runs there again.

Block ids: a replayed graph runs no host code, so its depths cannot refuse an id that
its view's ``token_to_block_idx`` or ``mha_block_table`` cannot hold (a narrower dtype
than ``block_table_dtype``: the copy would wrap it into another block). Two host
checks stand in: every captured depth records the ids its view holds
(``_captured_ids``, the narrowest range seen), and every later host-input
``begin_decode``, of either route (a graph may be replayed after a default-route
begin too), refuses a table entry outside it; a depth on a view narrower than what its
loop's begin checked scans that loop's host table first (``_loop_ids``). Device-input
begins are not value-checked (that would be a sync).
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from mtpmeta.validation.bounds import check_rows_fit
from mtpmeta.validation.checks import raise_position_error
from mtpmeta.errors import StaleOffsetsError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.types import ForwardRecord, ForwardShape

__all__ = ["CapturedLoop"]


class CapturedLoop:
    """The captured-loop half of ``MTPMetadata`` (see the module docstring)."""

    def _begin_captured(self, backend: Any, count: int, padded: int, starts: Any,
                        table: Any, on_device: bool, used: Any = None) -> None:
        """``begin_decode(..., capture_setup=True)`` for validated counts: stage
        ``offsets[:n]``, ``block_table[:n]`` and the device count, then enter DRAFT.
        Refuses (before any write) a padded count whose graph an earlier allocation
        holds."""
        if padded in self._orphaned_counts:
            raise ValueError(
                f"begin_decode: padded_count={padded} was prepared for capture "
                "(begin_decode_for_capture(..., capture_setup=True)) on buffers that "
                "deallocate()/allocate() have since replaced; a graph captured then "
                "holds the old buffers' addresses, and replaying it would read and write "
                "freed memory. Recapture after allocate(): call "
                f"begin_decode_for_capture({padded}, capture_setup=True) and capture the "
                "graph again")
        if on_device:  # mirror path only: copied on the device, count by a device fill
            backend.begin_decode_device(count, starts, table)
        else:
            self._check_begin_ids(table, count, used)  # before anything is written
            if not backend.begin_decode(count, starts, table, used):  # default staging,
                # which also stages the device count (captured.stage_count)
                raise_position_error(self._geometry, "start_positions", starts, count)
        self._enter_checked(count, padded, True)
        self._capture_setup = self._offsets_stale = True  # a replay runs no host code
        self._loop_ids = None if on_device else self._captured_ids

    def _check_begin_ids(self, table: np.ndarray, count: int, used: Any = None) -> None:
        """A host-input begin's ``table[:count]`` fits every view a captured depth
        wrote (``_captured_ids``), whatever the route: a graph holding the captured
        setup may replay after it. A ValueError naming the entry otherwise; free until
        a captured depth ran on a view narrower than ``block_table_dtype``."""
        ids = self._captured_ids
        if ids != self._geometry.table_range:
            check_rows_fit(table, count, ids, "block_table_src",
                           "the dtype of a view a captured depth wrote", _range_name(ids),
                           used)

    def _begin_captured_for_capture(self, padded: int) -> None:
        """``begin_decode_for_capture(p, capture_setup=True)`` after the default
        scratch fill: every one of the ``p`` rows is real for the device too."""
        self._enter_checked(padded, padded, True)  # the backend set the device count
        self._capture_setup = self._offsets_stale = True
        self._loop_ids = None  # rows of D, which every accepted view holds
        self._capture_counts.add(padded)  # graphs captured from here hold these buffers
        self._orphaned_counts.discard(padded)

    def _check_captured_ids(self, target: ViewTarget) -> None:
        """Narrow ``_captured_ids`` to what ``target`` holds and, when that is less
        than this loop's host table was checked against, scan the table's rows
        ``[:n]`` now (a ValueError before any device op)."""
        view_low = max(target.token_block_range[0], target.table_block_range[0])
        view_high = min(target.token_block_range[1], target.table_block_range[1])
        low, high = self._captured_ids
        self._captured_ids = (max(low, view_low), min(high, view_high))
        loop = self._loop_ids
        if loop is not None and (view_low > loop[0] or view_high < loop[1]):
            ids = (max(loop[0], view_low), min(loop[1], view_high))
            check_rows_fit(self._backend.host_block_table, self.active_request_count, ids,
                           "block_table (the draft loop's, from begin_decode)",
                           "gpu_view's token_to_block_idx / mha_block_table",
                           _range_name(ids))
            self._loop_ids = ids

    def _captured_step(self, target: ViewTarget, gpu_view: Any) -> ForwardShape:
        """One captured depth: device ops only; the graphed ``ForwardShape`` of §10."""
        count, padded = self.active_request_count, self.padded_count
        if target.token_block_range != self._captured_ids or \
                target.table_block_range != self._captured_ids:
            self._check_captured_ids(target)
        self._captured.decode_step(target, padded)
        record = self._decode_record
        if record is None or record.gpu_view is not gpu_view:
            record = ForwardRecord("decode", gpu_view, count, padded, count, padded)
            self._decode_record = record
        self.last_forward = record
        return self._memo.shape(count, padded, count, padded, 1,
                                self.max_kv_block_count * self.block_size_tokens)

    def _captured_advance(self) -> None:
        self._captured.advance_decode_step(self.padded_count)

    def _captured_lengths(self) -> None:
        self._captured.stage_decode_lengths(self.padded_count)

    def _refuse_stale(self, method: str) -> None:
        """Raise ``StaleOffsetsError``: a default-route call after a captured begin."""
        raise StaleOffsetsError(
            f"{method}: the last begin_decode opened a captured draft loop "
            "(capture_setup=True), whose depths and advances run on the device (in a "
            "graph replay, with no host code), so the host's copy of the offsets may be "
            "stale; call begin_decode (or begin_decode_for_capture) first")


def _range_name(ids: Tuple[int, int]) -> str:
    """How the messages name a range of ids: the integer dtype it is, if any."""
    for name in ("int8", "int16", "int32", "int64"):
        info = np.iinfo(name)
        if (int(info.min), int(info.max)) == ids:
            return f"torch.{name}"
    return f"[{ids[0]}, {ids[1]}]"
