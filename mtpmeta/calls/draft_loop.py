"""``MTPMetadata``'s draft loop (contract §5): ``begin_decode`` and
``begin_decode_for_capture`` stage it; ``setup_decode_step``, ``stage_decode_lengths``
and ``advance_decode_step`` run each depth. A mixin of ``MTPMetadata``
(``mtpmeta.metadata``): each validates at the boundary (``mtpmeta.validation.checks``), then hands
the work to the backend, or a loop begun with ``capture_setup=True`` to ``CapturedLoop``
(``mtpmeta.calls.captured_loop``). The invariant: a depth runs only in DRAFT (a
``ForwardModeError`` otherwise, nothing changed), a refusal comes before any write, and
the loop allocates nothing and reads nothing back from the device.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from torch import Tensor

from mtpmeta.validation.checks import (check_begin_decode, check_decode_counts, check_decode_view,
                     check_draft_blocks, raise_draft_block, raise_position_error)
from mtpmeta.errors import ForwardModeError, MTPDisabledError
from mtpmeta.validation.inputs import check_flag
from mtpmeta.types import ForwardRecord, ForwardShape, MTPForwardMode

__all__ = ["DraftLoop"]

_DRAFT = MTPForwardMode.DRAFT  # bound once: an enum member lookup costs about 1k instructions


class DraftLoop:
    """The draft-loop half of ``MTPMetadata`` (see the module docstring)."""

    def begin_decode(self, active_request_count: int, padded_count: int,
                     start_positions: Tensor, block_table_src: Tensor,
                     graphed: bool, *, capture_setup: bool = False,
                     block_counts: Optional[Tensor] = None) -> None:
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
        context row ``i``: with paused rows first pass the active slice;
        ``check_invariants`` reports a depth that overwrites what the commit pass just
        before the loop wrote); block_table_src: int [>= n,
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
            backend = self._require("begin_decode")
        if type(graphed) is not bool:
            graphed = check_flag(graphed, "graphed")
        geometry = self._geometry
        count, padded, starts, table, on_device, used = check_begin_decode(
            geometry, active_request_count, padded_count, start_positions,
            block_table_src, block_counts)
        after = self.last_forward  # for check_invariants: the forward before the loop
        if capture_setup:
            self._begin_captured(backend, count, padded, starts, table, on_device, used)
            self._unchecked_table = None
            self._loop_after = after
            return
        if on_device:
            backend.begin_decode_device(count, starts, table, padded)
            self._unchecked_table = (table, count)  # for check_invariants only
        else:
            if self._captured_ids != geometry.table_range:  # a graph may replay after
                self._check_begin_ids(table, count, used)  # this begin: ids views hold
            if not backend.begin_decode(count, starts, table, used):  # bad start: no write
                raise_position_error(geometry, "start_positions", starts, count)
            self._unchecked_table = None
        self._enter_checked(count, padded, graphed)
        self._loop_after = after

    def begin_decode_for_capture(self, padded_count: int, *,
                                 capture_setup: bool = False) -> None:
        """Scratch-only draft state for CUDA-graph capture: ``offsets[:p] = 0``,
        ``block_table[:p] = D``, then DRAFT with ``n = p`` and ``graphed=True``.

        ``capture_setup=True``: the loop's setup calls are device ops only, to be
        captured with the forward (contract §12); a replay without a fresh ``begin_decode``
        continues from wherever the last one left the device offsets."""
        if not self.enabled:
            raise MTPDisabledError("begin_decode_for_capture: MTP KV caching is disabled "
                                   "(enabled=False)")
        backend = self._require("begin_decode_for_capture")
        _, padded = check_decode_counts(self._geometry, 0, padded_count)
        backend.begin_decode_for_capture(padded)
        self._unchecked_table = None
        if capture_setup:
            return self._begin_captured_for_capture(padded)
        self._enter_checked(padded, padded, True)

    def advance_decode_step(self) -> None:
        """Advance every active request's write position by one, in place (device
        buffer and host copy alike). Needs DRAFT (``ForwardModeError`` after
        ``end_forward`` or in COMMIT, changing nothing); the last depth's advance may
        step one past the table, where a setup is refused. In a captured loop
        (``capture_setup=True``): one device add over the ``padded_count`` rows, legal
        inside a capture."""
        backend = self._backend
        if backend is None or self._forward_mode is not _DRAFT:
            backend = self._require_draft_views("advance_decode_step")
        if self._capture_setup:
            return self._captured_advance()
        if self._offsets_stale:
            self._refuse_stale("advance_decode_step")
        backend.advance_decode_step(self.active_request_count)

    def stage_decode_lengths(self) -> Tuple[Tensor, Tensor]:
        """Stage one draft depth's MHA lengths: query 1, KV ``active_offsets + 1``.

        Returns views of ``query_lengths[:n]`` and ``kv_lengths[:n]``. Needs DRAFT
        (``ForwardModeError`` otherwise, changing nothing).
        """
        backend = self._backend
        if backend is None or self._forward_mode is not _DRAFT:
            backend = self._require_draft_views("stage_decode_lengths")
        if self._capture_setup:  # device ops over padded_count rows, pad rows 0
            self._captured_lengths()
            return self._active_lengths
        if self._offsets_stale:
            self._refuse_stale("stage_decode_lengths")
        backend.stage_decode_lengths(self.active_request_count)
        return self._active_lengths

    def setup_decode_step(self, gpu_view: Any) -> ForwardShape:
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
        if backend is None or self.active_offsets is None:
            backend = self._require_draft_views("setup_decode_step")
        if self._forward_mode is not _DRAFT:
            raise ForwardModeError(f"setup_decode_step: forward_mode is "
                                   f"{self._forward_mode.name}, expected DRAFT (call "
                                   "begin_decode first)")
        target = self._memo.target(gpu_view)
        count, padded = self.active_request_count, self.padded_count
        if padded > target.max_tokens or padded > target.max_requests or \
                target.width != self.max_kv_block_count:  # the cheap per-depth check
            check_decode_view(self._geometry, target, padded)
        if self._capture_setup:  # contract §12: device ops only, legal inside a capture
            return self._captured_step(target, gpu_view)
        if self._offsets_stale:  # a captured begin, then DRAFT re-entered by hand
            self._refuse_stale("setup_decode_step")
        if self._memo.narrow_table and backend.host_offsets_known:  # else no scan
            check_draft_blocks(self._geometry, target, backend.host_offsets,
                               backend.host_block_table, count, backend.named_counts)
        max_kv = backend.decode_step(target, count, padded, self.graphed)
        if max_kv < -1:  # the kernel found a bad written block and wrote nothing
            raise_draft_block(self._geometry, target, backend.host_offsets,
                              backend.host_block_table, -2 - max_kv,
                              backend.named_counts)
        if max_kv < 0:  # the kernel found a bad offset and wrote nothing
            raise_position_error(self._geometry, "active_offsets", backend.host_offsets,
                                 count)
        record = self._decode_record  # the depths of one draft loop share a record
        if record is None or record.gpu_view is not gpu_view:
            record = ForwardRecord("decode", gpu_view, count, padded, count, padded)
            self._decode_record = record
        self.last_forward = record
        if self.graphed:  # the capture-time bound, the same at every depth and step
            max_k = self.max_kv_block_count * self.block_size_tokens
        elif backend.host_offsets_known or not count:
            max_k = max_kv if max_kv > 1 else 1  # upstream floors an empty forward at 1
        else:  # offsets came from a device tensor: the maximum would cost a sync
            max_k = None
        return self._memo.shape(count, padded, count, padded, 1, max_k)
