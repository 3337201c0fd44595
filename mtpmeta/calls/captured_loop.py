"""``CapturedLoop``: the host-side guards of the captured draft loop (contract §12).

A draft loop begun with ``capture_setup=True`` runs its depths, advances and length
staging as device ops only (``mtpmeta.mirror.captured_route``), legal inside a CUDA
graph. ``DraftLoop`` (``mtpmeta.calls.draft_loop``) owns the loop and routes such a
loop's calls here and to the route; this object keeps what a replayed graph, which runs
no host code, cannot check for itself.

Graphs and allocations: a graph holds the addresses of the buffers it was captured on.
``prepared`` holds the padded counts ``begin_decode_for_capture(p,
capture_setup=True)`` prepared on this allocation, ``orphaned`` those prepared on an
earlier one only: a ``capture_setup`` begin at such a count is refused (its graph would
replay against freed buffers) until ``begin_decode_for_capture`` runs there again.

Block ids: a replayed graph cannot refuse an id that its view's ``token_to_block_idx``
or ``mha_block_table`` cannot hold (a narrower dtype than ``block_table_dtype``: the copy
would wrap it into another block). Two host checks stand in: every captured depth
records the ids its view holds (``ids``, the narrowest range seen), and every later
host-input ``begin_decode``, of either route (a graph may be replayed after a
default-route begin too), refuses a table entry outside it; a depth on a view narrower
than what its loop's begin checked scans that loop's host table first (``loop_ids``).
Device-input begins are not value-checked (that would be a sync).
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Set, Tuple

import numpy as np

from mtpmeta.calls.allocation import Allocation
from mtpmeta.errors import StaleOffsetsError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.validation.bounds import check_rows_fit
from mtpmeta.validation.checks import raise_position_error

__all__ = ["CapturedLoop", "raise_stale"]


class CapturedLoop:
    """Orphaned graph counts and block-id ranges of the captured route.

    Fields: ``ids`` (``(low, high)``: the ids every view a captured depth ran on holds;
    the allocation's ``block_table_dtype`` range until such a depth ran on a narrower
    view; None without an allocation), ``loop_ids`` (the range the current captured
    loop's host table is known to fit, or None: rows of ``D``, or a device table),
    ``prepared`` and ``orphaned`` (sets of padded counts, above). Binds the allocation's
    backend (its ``[R, W]`` ``host_block_table``), ``Geometry`` and ``CapturedRoute``.
    """

    __slots__ = ("ids", "loop_ids", "prepared", "orphaned", "_backend", "_geometry",
                 "_route")

    def __init__(self) -> None:
        self.prepared: Set[int] = set()
        self.orphaned: Set[int] = set()
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind ``allocation`` (None: no buffers); counts prepared on the one before
        become orphaned, as their graphs hold its buffers."""
        self.orphaned |= self.prepared
        self.prepared = set()
        self.loop_ids: Optional[Tuple[int, int]] = None
        if allocation is None:
            self.ids = self._backend = self._geometry = self._route = None
        else:
            self.ids: Optional[Tuple[int, int]] = allocation.geometry.table_range
            self._backend = allocation.backend
            self._geometry = allocation.geometry
            self._route = allocation.captured

    def begin(self, count: int, padded: int, starts: Any, table: Any, on_device: bool,
              used: Any = None) -> None:
        """The staging of ``begin_decode(..., capture_setup=True)`` for validated
        counts: ``offsets[:n]``, ``block_table[:n]`` and the device count. Refuses
        (before any write) a padded count whose graph an earlier allocation holds."""
        if padded in self.orphaned:
            raise ValueError(
                f"begin_decode: padded_count={padded} was prepared for capture "
                "(begin_decode_for_capture(..., capture_setup=True)) on buffers that "
                "deallocate()/allocate() have since replaced; a graph captured then "
                "holds the old buffers' addresses, and replaying it would read and write "
                "freed memory. Recapture after allocate(): call "
                f"begin_decode_for_capture({padded}, capture_setup=True) and capture the "
                "graph again")
        backend = self._backend
        if on_device:  # mirror path only: copied on the device, count by a device fill
            backend.begin_decode_device(count, starts, table)
        else:
            self.check_begin_ids(table, count, used)  # before anything is written
            if not backend.begin_decode(count, starts, table, used):  # default staging,
                # which also stages the device count (captured.stage_count)
                raise_position_error(self._geometry, "start_positions", starts, count)
        self.loop_ids = None if on_device else self.ids

    def prepare(self, padded: int) -> None:
        """``begin_decode_for_capture(p, capture_setup=True)`` ran: graphs captured
        from here hold these buffers; its rows are ``D``, which every accepted view
        holds."""
        self.loop_ids = None
        self.prepared.add(padded)
        self.orphaned.discard(padded)

    def check_begin_ids(self, table: np.ndarray, count: int, used: Any = None) -> None:
        """A host-input begin's ``table[:count]`` fits every view a captured depth
        wrote (``ids``), whatever the route: a graph holding the captured setup may
        replay after it. A ValueError naming the entry otherwise; free until a captured
        depth ran on a view narrower than ``block_table_dtype``."""
        ids = self.ids
        if ids != self._geometry.table_range:
            check_rows_fit(table, count, ids, "block_table_src",
                           "the dtype of a view a captured depth wrote", _range_name(ids),
                           used)

    def step(self, target: ViewTarget, count: int, padded: int) -> None:
        """One captured depth over ``padded`` rows (``count`` real on the host): the
        id checks, then the route's device ops."""
        ids = self.ids
        if target.token_block_range != ids or target.table_block_range != ids:
            self._narrow_ids(target, count)
        self._route.decode_step(target, padded)

    def _narrow_ids(self, target: ViewTarget, count: int) -> None:
        """Narrow ``ids`` to what ``target`` holds and, when that is less than this
        loop's host table was checked against, scan the table's rows ``[:count]`` now
        (a ValueError before any device op)."""
        view_low = max(target.token_block_range[0], target.table_block_range[0])
        view_high = min(target.token_block_range[1], target.table_block_range[1])
        low, high = self.ids
        self.ids = (max(low, view_low), min(high, view_high))
        loop = self.loop_ids
        if loop is not None and (view_low > loop[0] or view_high < loop[1]):
            ids = (max(loop[0], view_low), min(loop[1], view_high))
            check_rows_fit(self._backend.host_block_table, count, ids,
                           "block_table (the draft loop's, from begin_decode)",
                           "gpu_view's token_to_block_idx / mha_block_table",
                           _range_name(ids))
            self.loop_ids = ids


def raise_stale(method: str) -> NoReturn:
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
