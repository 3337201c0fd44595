"""``DraftLoop``: ``MTPMetadata``'s draft loop (contract §5). ``begin`` and
``begin_for_capture`` stage it; ``step``, ``stage_lengths`` and ``advance`` run each
depth; ``end`` closes it.

Each call validates at the boundary (``mtpmeta.validation.checks``), then hands the work
to the backend, or, in a loop begun with ``capture_setup=True``, to ``CapturedLoop``
(``mtpmeta.calls.captured_loop``) and the allocation's ``CapturedRoute``. The invariant:
a depth runs only in DRAFT (a ``ForwardModeError`` otherwise, nothing changed), a
refusal comes before any write, and the loop allocates nothing and reads nothing back
from the device.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Tuple

import numpy as np
from torch import Tensor

from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.captured_loop import CapturedLoop, raise_stale
from mtpmeta.calls.state import CallState, raise_unavailable
from mtpmeta.errors import ForwardModeError, MTPDisabledError
from mtpmeta.kernels import native
from mtpmeta.types import ForwardRecord, ForwardShape, MTPForwardMode
from mtpmeta.validation.checks import (check_begin_decode, check_decode_counts,
                                       check_decode_view, check_draft_blocks,
                                       raise_draft_block, raise_position_error)
from mtpmeta.validation.inputs import check_flag
from mtpmeta.validation.request_rows import raise_protected_start, raise_split_ended

__all__ = ["DraftLoop"]

_first_protected_start = native.checks.first_protected_start
_DRAFT = MTPForwardMode.DRAFT  # bound once: an enum member lookup costs about 1k instructions


class DraftLoop:
    """The staged draft loop and the calls that run it.

    Fields of the loop (public as ``MTPMetadata``'s ``active_request_count``,
    ``padded_count``, ``graphed``, ``active_offsets``, ``active_block_table``):
    ``count`` (``n``), ``padded`` (``p >= n``), ``graphed`` (bool), ``offsets``
    (``offsets[:n]``, ``[n]`` int32) and ``block_table`` (``block_table[:n]``, ``[n,
    W]``), views of the persistent buffers (None before a begin on this allocation),
    ``lengths`` (``(query_lengths[:n], kv_lengths[:n])``); for ``check_invariants``:
    ``record`` (the ``ForwardRecord`` the loop's depths share), ``loop_after`` (the
    ``last_forward`` when the loop began) and ``unchecked_table`` (``(device
    block_table_src, n)`` of a device-route begin, until the next check compares the
    buffer with it). Two flags: ``capture_setup`` (this loop takes the captured route;
    set by a ``capture_setup=True`` begin, cleared by any other begin and by ``end``)
    and ``offsets_stale`` (set by every ``capture_setup`` begin, cleared by any other
    begin: a graph replay may advance the offsets with no host code, so from that begin
    on the host copy of the offsets is not the truth).

    Binds the allocation's backend, ``Geometry``, ``ForwardMemo`` (and its ``active``
    and ``shapes`` caches) and ``CapturedRoute``; ``captured`` is the captured route's
    ``CapturedLoop``.
    """

    __slots__ = ("_state", "captured", "count", "padded", "graphed", "offsets",
                 "block_table", "lengths", "record", "loop_after", "unchecked_table",
                 "capture_setup", "offsets_stale", "_backend", "_geometry", "_memo",
                 "_active", "_shapes", "_route", "_table_range", "_width", "_bound_k",
                 "_annotations", "_no_spans", "first_row")

    def __init__(self, state: CallState) -> None:
        self._state = state
        self.captured = CapturedLoop()
        self.count = self.padded = 0
        self.graphed = False
        self.record: Optional[ForwardRecord] = None
        self.loop_after: Optional[ForwardRecord] = None
        self.first_row = 0  # draft_annotation_offset at the begin (its records keep it)
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind ``allocation`` (None: no buffers) with no loop staged on it."""
        self.captured.install(allocation)
        self.offsets = self.block_table = self.lengths = self.unchecked_table = None
        self.capture_setup = self.offsets_stale = False
        if allocation is None:
            self._backend = self._geometry = self._memo = self._active = None
            self._shapes = self._route = self._table_range = None
            self._annotations = self._no_spans = None
            self._width = self._bound_k = 0
            return
        self._annotations = allocation.buffers.annotations  # [R] int32 host
        self._no_spans = np.zeros((2, 1), dtype=np.int64)  # no commit pass to compare
        geometry = self._geometry = allocation.geometry
        self._backend = allocation.backend
        self._memo = allocation.memo
        self._active = allocation.memo.active
        self._shapes = allocation.memo.shapes
        self._route = allocation.captured
        self._table_range = geometry.table_range
        self._width = geometry.max_kv_block_count
        # a graphed depth's max_seqlen_k: the capture-time bound
        self._bound_k = geometry.max_kv_block_count * geometry.block_size_tokens

    def begin(self, active_request_count: Any, padded_count: Any, start_positions: Any,
              block_table_src: Any, graphed: Any, capture_setup: bool,
              block_counts: Any) -> None:
        """Stage the draft loop: copy (never alias) ``start_positions[:n]`` into
        ``offsets[:n]`` and ``block_table_src[:n]`` into ``block_table[:n]``; enter DRAFT.

        ``capture_setup=True`` (implies ``graphed=True``) opens a captured draft loop
        (contract §12, README "Captured draft loop"): the device count ``n`` is staged too,
        and the loop's ``setup_decode_step`` / ``advance_decode_step`` are then device
        ops only, legal inside a CUDA graph captured after
        ``begin_decode_for_capture(padded_count, capture_setup=True)``. Use the same
        ``padded_count`` the replayed graph was captured at, replay it on the stream this
        begin ran on, and recapture after ``deallocate``/``allocate`` (a captured begin at
        a count prepared for capture on an earlier allocation is a ``ValueError``).

        start_positions: int [>= n] (tensor, array or sequence): per ACTIVE request the
        position depth 0 writes, its MTP KV length (entry ``i`` is draft row ``i``, not
        context row ``i``: with paused rows first pass the active slice, or declare the
        step's split, ``set_request_rows``, which this begin ends and which refuses a
        host start inside the row's inherited blocks or inside the span the commit
        pass just before wrote; ``check_invariants`` reports a depth that overwrites
        what that pass wrote); block_table_src: int [>= n,
        max_kv_block_count]; graphed: a bool (or numpy bool). Host inputs are checked:
        every entry of ``block_table_src[:n]`` must fit ``block_table_dtype`` (a wider id
        would wrap into another block), and each depth then refuses a negative
        (unallocated) block in the column a row writes; once a captured depth
        (contract §12) ran on a view narrower than ``block_table_dtype``, every host
        ``block_table_src`` of either route must fit that view too (a graph may replay
        after any begin). Device tensors (mirror path) are
        copied on the device and are NOT value-checked (that would be a sync): an id that
        does not fit is converted as torch's ``copy_`` converts it (``check_invariants``
        flags it afterwards); the host then has no copy of the offsets and
        ``ForwardShape.max_seqlen_k`` is None. ``block_counts``: opt-in, contract §5.
        """
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "begin_decode")
        split = self._state.split
        if split is not None:  # whole context arrays give their active rows
            start_positions, block_table_src, block_counts = split.active(
                active_request_count, "active_request_count", start_positions,
                block_table_src, block_counts)
        elif self._state.split_ended:
            raise_split_ended("begin_decode")
        if type(graphed) is not bool:
            graphed = check_flag(graphed, "graphed")
        geometry = self._geometry
        count, padded, starts, table, on_device, used = check_begin_decode(
            geometry, active_request_count, padded_count, start_positions,
            block_table_src, block_counts)
        state = self._state
        after = state.last_forward  # for check_invariants: the forward before the loop
        if split is not None and not on_device:  # a draft never writes a protected place
            self._refuse_protected_starts(split.paused, starts, count, after)
        if capture_setup:
            self.captured.begin(count, padded, starts, table, on_device, used)
            state.end_split()  # the step's split ends with its draft loop's begin
            self._enter(count, padded, True)
            self.capture_setup = self.offsets_stale = True  # a replay runs no host code
            self.unchecked_table = None
            self.loop_after = after
            return
        if on_device:
            backend.begin_decode_device(count, starts, table, padded)
            self.unchecked_table = (table, count)  # for check_invariants only
        else:
            captured = self.captured
            if captured.ids != self._table_range:  # a graph may replay after this
                captured.check_begin_ids(table, count, used)  # begin: ids views hold
            if not backend.begin_decode(count, starts, table, used):  # bad start: no write
                raise_position_error(geometry, "start_positions", starts, count)
            self.unchecked_table = None
        state.end_split()  # the step's split ends with its draft loop's begin
        views = self._active.get(count)  # _enter, inlined: every step begins a loop
        if views is None:  # views of the fixed buffers, built once per count
            views = self._memo.add_active(count)
        self.count = count
        self.padded = padded
        self.offsets, self.block_table, self.lengths = views
        self.graphed = graphed
        state.mode = _DRAFT
        self.record = None  # a new draft loop: its first depth makes a record
        self.first_row = state.annotation_offset
        self.capture_setup = self.offsets_stale = False
        self.loop_after = after

    def _refuse_protected_starts(self, first_row: int, starts: Any, count: int,
                                 after: Optional[ForwardRecord]) -> None:
        """Refuse a host start inside its context row's inherited blocks, or inside
        the span the commit pass right before wrote for that row (``CallState.
        committed``), before anything is written."""
        committed = self._state.committed
        spans = self._no_spans if committed is None or committed[0] is not after \
            else committed[1]
        code, row = _first_protected_start(starts, count, first_row, self._annotations,
                                           self._geometry.block_size_tokens, spans,
                                           spans is not self._no_spans)
        if code:
            raise_protected_start(code, row, first_row, starts, self._annotations, spans,
                                  self._geometry.block_size_tokens)

    def begin_for_capture(self, padded_count: Any, capture_setup: bool) -> None:
        """Scratch-only draft state for CUDA-graph capture: ``offsets[:p] = 0``,
        ``block_table[:p] = D``, then DRAFT with ``n = p`` and ``graphed=True``.

        ``capture_setup=True``: the loop's setup calls are device ops only, to be
        captured with the forward (contract §12); a replay without a fresh ``begin_decode``
        continues from wherever the last one left the device offsets."""
        if not self._state.enabled:
            raise MTPDisabledError("begin_decode_for_capture: MTP KV caching is disabled "
                                   "(enabled=False)")
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "begin_decode_for_capture")
        _, padded = check_decode_counts(self._geometry, 0, padded_count)
        backend.begin_decode_for_capture(padded)
        self.unchecked_table = None
        self._enter(padded, padded, True)
        if capture_setup:  # every one of the p rows is real for the device too
            self.capture_setup = self.offsets_stale = True
            self.captured.prepare(padded)

    def _enter(self, count: int, padded: int, graphed: bool) -> None:
        """Enter DRAFT at validated counts with the active views (views of the fixed
        buffers); the default route, until the caller sets the captured flags."""
        views = self._active.get(count)
        if views is None:
            views = self._memo.add_active(count)
        self.count = count
        self.padded = padded
        self.offsets, self.block_table, self.lengths = views
        self.graphed = graphed
        self._state.mode = _DRAFT
        self.record = None
        self.first_row = self._state.annotation_offset
        self.loop_after = None
        self.capture_setup = self.offsets_stale = False

    def end(self) -> None:
        """Leave MTP-forward mode; no buffer changes. A captured draft loop
        (``capture_setup=True``) ends here too: after it, default-route draft calls
        need a new ``begin_decode`` (``StaleOffsetsError``)."""
        self._state.mode = MTPForwardMode.NONE
        self.capture_setup = False

    def _require_loop(self, method: str) -> Any:
        """The backend, when a draft loop is staged and in DRAFT; else the error."""
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, method)
        if self.offsets is None:
            raise ForwardModeError(f"{method}: no draft loop is staged; call begin_decode "
                                   "first")
        mode = self._state.mode
        if mode is not _DRAFT:
            raise ForwardModeError(f"{method}: forward_mode is {mode.name}, expected DRAFT "
                                   "(the draft loop ended; call begin_decode to start a "
                                   "new one)")
        return backend

    def advance(self) -> None:
        """Advance every active request's write position by one, in place (device
        buffer and host copy alike). Needs DRAFT (``ForwardModeError`` after
        ``end_forward`` or in COMMIT, changing nothing); the last depth's advance may
        step one past the table, where a setup is refused. In a captured loop
        (``capture_setup=True``): one device add over the ``padded_count`` rows, legal
        inside a capture."""
        backend = self._backend
        if backend is None or self._state.mode is not _DRAFT:
            backend = self._require_loop("advance_decode_step")
        if self.capture_setup:  # one device add over the padded rows
            return self._route.advance_decode_step(self.padded)
        if self.offsets_stale:
            raise_stale("advance_decode_step")
        backend.advance_decode_step(self.count)

    def stage_lengths(self) -> Tuple[Tensor, Tensor]:
        """Stage one draft depth's MHA lengths: query 1, KV ``active_offsets + 1``.

        Returns views of ``query_lengths[:n]`` and ``kv_lengths[:n]``. Needs DRAFT
        (``ForwardModeError`` otherwise, changing nothing).
        """
        backend = self._backend
        if backend is None or self._state.mode is not _DRAFT:
            backend = self._require_loop("stage_decode_lengths")
        if self.capture_setup:  # device ops over padded_count rows, pad rows 0
            self._route.stage_decode_lengths(self.padded)
            return self.lengths
        if self.offsets_stale:
            raise_stale("stage_decode_lengths")
        backend.stage_decode_lengths(self.count)
        return self.lengths

    def step(self, gpu_view: Any) -> ForwardShape:
        """One draft depth in one call: token maps for rows ``0..n-1`` at
        ``active_offsets`` through ``active_block_table`` padded to ``padded_count``,
        ``stage_decode_lengths``, and MHA metadata padded to ``padded_count``.

        Needs DRAFT mode. Refuses (before any write) a depth where a real row's
        block ``block_table[i, offsets[i] // BS]`` is negative (unallocated) or does not
        fit the view's ``token_to_block_idx``, or where ``block_table_dtype`` is wider
        than ``mha_block_table`` and a row's entry does not fit it; not checked after a
        device-tensor ``begin_decode``. Returns the launch shape, computed on the host:
        no sync.
        ``max_seqlen_q`` is 1; ``max_seqlen_k`` is ``max_kv_block_count *
        block_size_tokens`` for a graphed loop (the capture-time bound, so a captured
        kernel's launch bounds never change), else the largest KV length (at least 1),
        or None after ``begin_decode`` got device-tensor start positions.

        On the mirror path every depth, eager or graphed, computes its token maps and
        lengths from the host copy of the offsets and block table that
        ``begin_decode`` staged (and ``advance_decode_step`` keeps), and copies its
        ``mha_block_table`` rows from the device ``block_table``: an in-place edit of
        ``active_offsets`` / ``active_block_table`` reaches the second and not the
        first, so do not edit them; call ``begin_decode`` again instead. The direct
        path reads the buffers for both.

        In a captured loop (``capture_setup=True``, contract §12) the depth is device ops
        only on both paths (``mtpmeta.mirror.captured_route``), legal inside a CUDA graph capture:
        pad rows are masked with the device count, a block column past the table goes
        to ``D``, and the shape is the graphed one. After such a loop, the default
        route refuses until the next begin without ``capture_setup``
        (``StaleOffsetsError``, nothing written): a replay may have advanced the
        device offsets past the host's copy.
        """
        backend = self._backend
        if backend is None or self.offsets is None:
            backend = self._require_loop("setup_decode_step")
        state = self._state
        if state.mode is not _DRAFT:
            _raise_not_draft(state.mode)
        target = self._memo.target(gpu_view)
        count, padded = self.count, self.padded
        if padded > target.max_tokens or padded > target.max_requests or \
                target.width != self._width:  # the cheap per-depth check
            check_decode_view(self._geometry, target, padded)
        if self.capture_setup:  # contract §12: device ops only, legal inside a capture
            self.captured.step(target, count, padded)
            max_k = self._bound_k
        else:
            if self.offsets_stale:  # a captured begin, then DRAFT re-entered by hand
                raise_stale("setup_decode_step")
            if self._memo.narrow_table and backend.host_offsets_known:  # else no scan
                check_draft_blocks(self._geometry, target, backend.host_offsets,
                                   backend.host_block_table, count, backend.named_counts)
            max_kv = backend.decode_step(target, count, padded, self.graphed)
            if max_kv < -1:  # the kernel found a bad written block and wrote nothing
                raise_draft_block(self._geometry, target, backend.host_offsets,
                                  backend.host_block_table, -2 - max_kv,
                                  backend.named_counts)
            if max_kv < 0:  # the kernel found a bad offset and wrote nothing
                raise_position_error(self._geometry, "active_offsets",
                                     backend.host_offsets, count)
            if self.graphed:  # the capture-time bound, the same at every depth and step
                max_k = self._bound_k
            elif backend.host_offsets_known or not count:
                max_k = max_kv if max_kv > 1 else 1  # upstream floors an empty one at 1
            else:  # offsets came from a device tensor: the maximum would cost a sync
                max_k = None
        record = self.record  # the depths of one draft loop share a record
        if record is None or record.gpu_view is not gpu_view:
            record = self.record = ForwardRecord("decode", gpu_view, count, padded, count,
                                                 padded, None, None, self.first_row)
        state.last_forward = record
        fields = (count, padded, count, padded, 1, max_k)
        shape = self._shapes.get(fields)
        return shape if shape is not None else self._memo.shape(*fields)


def _raise_not_draft(mode: MTPForwardMode) -> NoReturn:
    raise ForwardModeError(f"setup_decode_step: forward_mode is {mode.name}, expected "
                           "DRAFT (call begin_decode first)")
