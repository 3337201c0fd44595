"""``MTPMetadata``: the public class. It validates every input at the boundary, then
routes the work to the direct backend (numba kernels writing CPU buffers in place) or
the mirror backend (numba staging into pinned host memory, async copies, and a few
CUDA-graph-safe torch ops on the device).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from mtpmeta.kernels import native
from mtpmeta.validation.checks import (check_allocate, check_carry, check_commit_inputs, check_config,
                     check_prefill_lengths, check_row_pair, check_take,
                     raise_commit_block, raise_refused_row_pair)
from mtpmeta.errors import CarryNotAllocatedError
from mtpmeta.validation.inputs import as_row_indices, check_flag, raise_row_out_of_range
from mtpmeta.calls.captured_loop import CapturedLoop
from mtpmeta.calls.draft_loop import DraftLoop
from mtpmeta.calls.writers import ViewWriters
from mtpmeta.calls.state import MetadataState, carry_setter, install_debug_checks_from_env
from mtpmeta.types import ForwardRecord, ForwardShape, MTPForwardMode

__all__ = ["MTPMetadata"]

# Row indices of the row-lifecycle methods: whatever torch indexing of an [R] tensor
# takes. A slice, an int, a sequence of ints, a 1-D integer numpy array or tensor (a
# device tensor is read back, one sync), or a boolean mask of length R. Ints lie in
# [-R, R), as torch's.
Indices = Union[slice, int, Sequence[int], np.ndarray, Tensor]
_NONE, _COMMIT = MTPForwardMode.NONE, MTPForwardMode.COMMIT
# Kernels the per-step methods call, bound once (a module attribute chain costs two
# lookups per call on the hot path).
_move_rows, _swap_rows, _reset_rows = (native.rows.move_rows, native.rows.swap_rows,
                                       native.rows.reset_rows)
_record_carry = native.carry.record


class MTPMetadata(MetadataState, CapturedLoop, DraftLoop, ViewWriters):
    """MTP request annotations, chunk carry, and KV-cache forward buffers.

    A drop-in for upstream's pure-torch class (``core.inference.contexts.mtp_metadata``):
    same constructor, attributes and methods, plus two fused per-forward entry points
    (``setup_decode_step``, ``setup_commit_pass``) that return a host-computed
    ``ForwardShape``. The persistent buffers are fixed-address and sized for the worst
    case; the draft loop allocates nothing and reads nothing back from the device.

    Args:
        enabled: whether MTP KV caching is active. When False the object is inert.
        max_requests: worst-case active request count ``R``.
        max_kv_block_count: block-table width ``W``.
        block_size_tokens: KV block size ``BS``.
        dummy_block_idx: scratch block ``D`` that padded rows read and write.
        block_table_dtype: integer dtype of the block tables (``gpu_view.mha_block_table``).
        hidden_size: model hidden size (the chunk carry holds ``[1, 1, hidden_size]``).
        hidden_dtype: dtype of the main model's hidden states.

    ``enabled`` takes a bool (or a numpy bool) only. ``dummy_block_idx`` must be
    ``>= 0`` and fit ``block_table_dtype``. The eight arguments are kept as attributes
    of the same names.

    Attributes:
        forward_mode: ``MTPForwardMode`` (``NONE``/``DRAFT``/``COMMIT``); assignable
            with an ``MTPForwardMode`` only.
        graphed: bool, the ``graphed`` of the last ``begin_decode`` (True after
            ``begin_decode_for_capture``).
        active_request_count: ``n`` of the staged draft loop.
        padded_count: the padded count of the staged draft loop (``>= n``).
        active_offsets: ``offsets[:n]``, a view of the persistent buffer (None before
            ``begin_decode``).
        active_block_table: ``block_table[:n]``, a view (None before ``begin_decode``).
        last_forward: ``ForwardRecord`` of the last view-writing call, read by
            ``check_invariants`` (None before any).
        draft_annotation_offset: int, default 0: the paused-row count when paused rows
            come first, so that draft row ``i`` belongs to annotation row
            ``draft_annotation_offset + i`` (read by ``check_invariants``). Set it before
            the step's commit pass: while it is non-zero, ``setup_commit_pass`` and
            ``write_token_maps`` refuse ``inherited_blocks`` that is
            ``request_matched_prefix_blocks`` from row 0 (the whole buffer, not the
            active slice), a ``ValueError``.
        request_matched_prefix_blocks, offsets, block_table, query_lengths,
            kv_lengths, row_ids, chunk_boundary_hidden: the persistent buffers
            (read-only properties, None before ``allocate``).
        chunk_boundary_valid, chunk_boundary_req_id, chunk_boundary_position: the
            chunk carry's state.
        mirror, device: the path and device ``allocate`` chose (None before it).

    Indices: what the row-lifecycle methods take as row indices: a slice, an int, a
    sequence of ints, a 1-D integer numpy array or tensor (a device tensor is read
    back, one sync) or a boolean mask of length ``max_requests``; ints in ``[-R, R)``.
    """

    def __init__(self, enabled: bool, max_requests: int, max_kv_block_count: int,
                 block_size_tokens: int, dummy_block_idx: int,
                 block_table_dtype: torch.dtype, hidden_size: int,
                 hidden_dtype: torch.dtype) -> None:
        self.enabled = check_flag(enabled, "enabled")
        if self.enabled:
            check_config(max_requests, max_kv_block_count, block_size_tokens,
                         dummy_block_idx, block_table_dtype, hidden_size, hidden_dtype)
        self.max_requests = max_requests
        self.max_kv_block_count = max_kv_block_count
        self.block_size_tokens = block_size_tokens
        self.dummy_block_idx = dummy_block_idx
        self.block_table_dtype = block_table_dtype
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype

        self._forward_mode: MTPForwardMode = MTPForwardMode.NONE
        self._inherited_copy: Optional[np.ndarray] = None
        self.graphed: bool = False
        self.active_request_count: int = 0
        self.padded_count: int = 0
        self.active_offsets: Optional[Tensor] = None  # offsets[:n] view
        self.active_block_table: Optional[Tensor] = None  # block_table[:n] view
        # The last view-writing call, for check_invariants (None before any).
        self.last_forward: Optional[ForwardRecord] = None
        # Annotation row of draft row 0 (the paused-row count when paused rows come
        # first): draft row i belongs to request_matched_prefix_blocks[offset + i], for
        # check_invariants; non-zero, it also refuses the whole buffer as inherited_blocks.
        self.draft_annotation_offset: int = 0
        self._init_state()  # the carry state and no allocation

    # ----------------------------------------------------------------- properties
    request_matched_prefix_blocks = property(
        lambda self: self._buffer("request_matched_prefix_blocks"),
        doc="[R] int32 host: leading KV blocks each row inherited from the prefix cache. "
            "None before allocate() and after deallocate() (contract §1), so an in-place "
            "write then fails on None (a TypeError): call allocate(device) first, then "
            "write the annotations again (allocate zeroes them); the row methods "
            "(reset/move/swap_request_rows) raise NotAllocatedError saying so.")
    offsets = property(lambda self: self._buffer("offsets"),
                       doc="[R] int32 device: draft write position per request.")
    block_table = property(lambda self: self._buffer("block_table"),
                           doc="[R, W] block_table_dtype device: the draft loop's table.")
    query_lengths = property(lambda self: self._buffer("query_lengths"),
                             doc="[R] int32 device: MHA query-length staging.")
    kv_lengths = property(lambda self: self._buffer("kv_lengths"),
                          doc="[R] int32 device: MHA KV-length staging.")
    row_ids = property(lambda self: self._buffer("row_ids"),
                       doc="[R] int64 device: constant 0..R-1.")
    chunk_boundary_hidden = property(lambda self: self._buffer("chunk_boundary_hidden"),
                                     doc="[1, 1, hidden_size] device: the carried hidden.")

    chunk_boundary_valid = property(
        lambda self: bool(self._carry_state[0]), carry_setter(0, lambda v: 1 if v else 0),
        doc="Whether a chunk-boundary carry is live.")
    chunk_boundary_req_id = property(
        lambda self: int(self._carry_state[1]), carry_setter(1),
        doc="Request id the carry belongs to (-1 when none).")
    chunk_boundary_position = property(
        lambda self: int(self._carry_state[2]), carry_setter(2),
        doc="Prompt position the carried hidden was computed at (-1 when none).")

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, device: Union[torch.device, str], *,
                 mirror: Optional[bool] = None, max_tokens: int = 16384,
                 staging_slots: int = 8) -> None:
        """Reserve the persistent buffers (and the host staging). No-op when disabled.

        Args:
            device: device of the GPU-resident buffers.
            mirror: ``None`` mirrors exactly when ``device`` is not the CPU; ``True``
                forces the mirror path (pinned staging + async copies + device ops) on
                any device, the CPU included; ``False`` demands a CPU device.
            max_tokens: token capacity the mirror path's forward staging is sized for
                (tokens one ``write_token_maps``/commit pass writes). A larger forward
                re-sizes the staging once, to at least twice its size (ever-larger
                forwards re-size O(log n) times), outside the draft loop (which stages
                at most ``max_requests`` tokens). Unused on the direct path.
            staging_slots: pinned slots per staging ring on the mirror path: how many
                staged forwards the host may run ahead of the device before a fence
                wait stalls it (see docs/architecture.md "Mirror path costs"). Unused
                on the direct path.

        The device runtime (streams, events, pinned memory; ``mtpmeta.buffers.device_runtime``) in
        effect now is the one these buffers use for their lifetime.
        """
        if not self.enabled:
            return
        device, mirror = check_allocate(device, mirror, max_tokens, staging_slots)
        self._install(*self._allocation(device, mirror, max_tokens, staging_slots))

    def deallocate(self) -> None:
        """Release every buffer, mirroring ``allocate`` (the suspend path). A CUDA graph
        holding a captured draft-loop setup (``capture_setup=True``) keeps the released
        buffers' addresses: recapture it after the next ``allocate``."""
        self._install(None, None, None)

    # -------------------------------------------------------------- row lifecycle
    def reset_request_rows(self, request_indexes: Indices = slice(None)) -> None:
        """Clear annotations of released/reused rows: ``x[request_indexes] = 0``.

        Takes a slice, an int, a sequence, a numpy array, a tensor (a device tensor is
        read back, one sync) or a boolean mask. No-op when disabled.
        """
        if not self.enabled:
            return
        buffers = self._buffers
        if buffers is None:
            self._require("reset_request_rows")
        rows = as_row_indices(request_indexes, self.max_requests, "request_indexes")
        if type(rows) is slice:
            buffers.annotations[rows] = 0
            return
        bad = _reset_rows(buffers.annotations, rows)
        if bad >= 0:  # refused before any write
            raise_row_out_of_range(rows, bad, self.max_requests, "request_indexes")

    def move_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        """``x[dst] = x[src]``: every source is read before any destination is written,
        so overlapping ranges are safe; sources keep their values. No-op when disabled."""
        if not self.enabled:
            return
        buffers = self._buffers
        if buffers is None:
            self._require("move_request_rows")
        src, dst = check_row_pair(self._geometry, "move_request_rows", src_idxs, dst_idxs)
        scratch = buffers.row_scratch
        if len(src) > len(scratch):
            scratch = self._row_scratch(len(src))
        bad = _move_rows(buffers.annotations, src, dst, scratch)
        if bad >= 0:  # refused before any write
            raise_refused_row_pair(self._geometry, src, dst, bad)

    def swap_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        """Swap annotations: both sides read first, then ``x[dst] = old[src]``, then
        ``x[src] = old[dst]`` (an index on both sides keeps the second assignment).
        No-op when disabled."""
        if not self.enabled:
            return
        buffers = self._buffers
        if buffers is None:
            self._require("swap_request_rows")
        src, dst = check_row_pair(self._geometry, "swap_request_rows", src_idxs, dst_idxs)
        scratch = buffers.row_scratch
        if 2 * len(src) > len(scratch):
            scratch = self._row_scratch(2 * len(src))
        bad = _swap_rows(buffers.annotations, src, dst, scratch)
        if bad >= 0:  # refused before any write
            raise_refused_row_pair(self._geometry, src, dst, bad)

    # --------------------------------------------------------------- chunk carry
    def invalidate_chunk_boundary(self) -> None:
        """Drop the carry: invalid, keys -1. The hidden buffer keeps its address."""
        native.carry.invalidate(self._carry_state)

    def carry_chunk_boundary(self, hidden: Tensor, req_id: int, position: int) -> None:
        """Copy ``hidden`` (any shape with ``hidden_size`` elements) into the persistent
        carry and record ``(req_id, position)``. No-op when disabled.

        Only a chunk whose seam is exactly ``position`` (``off == position + 1``) may
        take it. A host ``hidden`` on the mirror path is copied host-to-device.
        """
        if not self.enabled:
            return
        if self._buffers is None:
            self._require("carry_chunk_boundary")
        source, req_id, position = check_carry(self._geometry, hidden, req_id, position)
        self._backend.carry_hidden(source)
        _record_carry(self._carry_state, req_id, position)

    def take_chunk_boundary(self, req_id: int, seam_position: int) -> Tensor:
        """Return the ``[1, 1, hidden_size]`` carried hidden for this seam.

        Raises ``ChunkCarryError`` (an ``AssertionError``, raised explicitly so it holds
        under ``python -O``) when no carry is live, when it belongs to another request,
        or when it sits at another position than ``seam_position``.
        """
        if self.enabled and self._buffers is None:
            raise CarryNotAllocatedError(
                f"take_chunk_boundary: buffers are not allocated (call allocate(device) "
                f"first), so no chunk-boundary carry is live for request {req_id}")
        check_take(self._carry_state, req_id, seam_position)
        order = None if self._backend is None else self._backend.stream_order
        if order is not None:  # the caller's reads follow the carry's copy
            order.enter_unless_capturing()
        return self._buffers.chunk_boundary_hidden

    # ---------------------------------------------------------------- draft loop
    # (its begins, depths and advance are the ``DraftLoop`` mixin, ``draft_loop.py``)
    def end_forward(self) -> None:
        """Leave MTP-forward mode; no buffer changes. A captured draft loop
        (``capture_setup=True``) ends here too: after it, default-route draft calls
        need a new ``begin_decode`` (``StaleOffsetsError``)."""
        self._forward_mode = _NONE
        self._capture_setup = False

    # --------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, append_counts: Tensor, pad_tokens: int) -> Tensor:
        """Stage a varlen commit pass's lengths, absorbing ``pad_tokens`` TP pad rows.

        ``P = len(append_counts)``. The returned view of ``query_lengths`` is
        ``P + 1`` long when ``pad_tokens > 0 and P < R`` (the pad rows get their own
        trailing request), else ``P`` long (a full batch grows its last entry).
        Example: ``[3, 2]``, pad 3 -> ``[3, 2, 3]``; with R = 2 -> ``[3, 5]``.

        One buffer serves as query and KV lengths (a fresh causal prefill), so the
        pass's attention output is a request's true attention only for a span that
        starts at position 0; a span starting later populates KV, and its output is
        not meaningful (a token at ``start + j`` attends over positions ``0..j``).
        """
        backend = self._require("stage_prefill_lengths")
        counts, pad, on_device = check_prefill_lengths(self._geometry, append_counts,
                                                       pad_tokens)
        staged = (backend.stage_prefill_lengths_device if on_device
                  else backend.stage_prefill_lengths)(counts, pad)
        return self._memo.prefill_view(staged)

    def setup_commit_pass(self, gpu_view: Any, append_counts: Tensor, block_table: Tensor,
                          *, start_positions: Optional[Tensor] = None,
                          inherited_blocks: Optional[Tensor] = None,
                          padded_token_count: Optional[int] = None,
                          padded_request_count: Optional[int] = None,
                          block_counts: Optional[Tensor] = None) -> ForwardShape:
        """The whole varlen commit pass in one call; sets ``forward_mode = COMMIT``.

        Request ``r`` (row ``r`` of ``block_table``) writes ``append_counts[r]``
        consecutive positions from ``start_positions[r]`` (0 when None). Token maps with
        the inherited-block redirect, padded to ``padded_token_count`` (default: the
        total ``T``); ``stage_prefill_lengths`` with ``pad = padded_token_count - T``; MHA
        metadata over ``max(padded_request_count or P, staged)`` slots with one length
        buffer for query and KV.

        append_counts: int [P]; block_table: int [>= P, view width]; start_positions,
        inherited_blocks: int [>= P]. Host inputs are checked in full and cost no sync;
        device tensors are read back to the host with one ``.cpu()`` each, one sync
        each: ``append_counts``, ``block_table``, ``start_positions`` and
        ``inherited_blocks`` (their values decide the staging and the returned shape).
        Keep them on the host to keep the commit pass free of syncs.
        ``inherited_blocks`` is per commit-pass request: the ACTIVE slice of the
        annotations (``request_matched_prefix_blocks[paused:total]``), never the whole
        array, which with paused rows redirects the wrong requests (refused, a
        ``ValueError``, when ``draft_annotation_offset`` is non-zero); its counts lie in
        ``[0, max_kv_block_count]`` and are copied for ``check_invariants`` at the call.
        Block ids: the rows ``block_table[:P]`` must fit ``gpu_view.mha_block_table``,
        and every block a token writes (not redirected) must be ``>= 0`` and fit
        ``gpu_view.token_to_block_idx``; refused before anything is written.

        Attention output: KV length equals query length (a fresh causal prefill), so
        it is meaningful only for spans starting at position 0; later spans populate
        KV. ``ForwardShape.max_seqlen_q == max_seqlen_k`` is the largest staged length
        (at least 1). When ``P == R`` and there is token padding, request ``P - 1``
        absorbs the pad rows and its KV span runs past what it writes: its
        ``mha_block_table`` columns that lie wholly at or past ``start + count`` point at
        the dummy block (upstream copies the caller's row, -1 entries included).
        Example: BS 4, R 2, counts [3, 3], tables [[0, -1], [1, -1]], 8 tokens ->
        lengths [3, 5], request 1 reads row [1, D]. ``block_counts``: opt-in, contract §5.
        """
        backend = self._backend or self._require("setup_commit_pass")
        self._refuse_whole_annotations("setup_commit_pass", inherited_blocks)
        target = self._memo.target(gpu_view)
        (counts, starts, table, inherited, total, padded_tokens, pad, min_padded,
         padded_requests, used) = check_commit_inputs(
            self._geometry, target, append_counts, block_table, start_positions,
            inherited_blocks, padded_token_count, padded_request_count, block_counts)
        refused, staged, padded_requests, max_len = backend.commit_pass(
            target, counts, starts, table, inherited, padded_tokens, pad, min_padded,
            padded_requests, used)
        if refused < 0:  # a bad written block or inherited count: nothing written
            raise_commit_block(self._geometry, target, -refused, staged, padded_requests,
                               counts, starts, table, inherited)
        self._forward_mode, total = _COMMIT, int(total)
        self.last_forward = ForwardRecord("commit", gpu_view, total, padded_tokens,
                                          staged, padded_requests,
                                          self._record_inherited(inherited))
        max_len = int(max_len) if max_len > 1 else 1  # upstream floors an empty one at 1
        return self._memo.shape(total, padded_tokens, staged, padded_requests, max_len,
                                max_len)

    # ----------------------------------------------------------------- debugging
    def check_invariants(self, gpu_view: Any = None) -> None:
        """Check this object's invariants and those of the last forward's destination
        view.

        Raises ``InvariantError`` (an ``AssertionError``, raised explicitly so it holds
        under ``python -O``) naming the broken invariant and the offending row, token or
        slot. ``gpu_view`` defaults to the view of ``last_forward`` (anything but a
        destination view is a ``ValueError``). A debug tool: it
        reads the buffers and the view back (a sync on CUDA). The list is in
        ``mtpmeta.debug.invariants``.
        """
        from mtpmeta.debug.invariants import check_invariants

        check_invariants(self, gpu_view)

# --- debug checks (mtpmeta.debug.invariants) ---
install_debug_checks_from_env(MTPMetadata)  # MTPMETA_DEBUG=1 wraps the public methods
# --- end debug checks (mtpmeta.debug.invariants) ---
