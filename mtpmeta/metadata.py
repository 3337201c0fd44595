"""``MTPMetadata``: the public class. It validates every input at the boundary, then
routes the work to the direct backend (numba kernels writing CPU buffers in place) or the
mirror backend (numba staging in pinned memory, async copies, a few graph-safe torch ops).

Its calls are carried out by objects it holds, one group of calls each (``mtpmeta.calls``):
``_rows`` (``RowLifecycle``), ``_carry`` (``ChunkCarry``), ``_draft`` (``DraftLoop``, with
the captured route's ``CapturedLoop``), ``_commit`` (``CommitPass``) and ``_writers``
(``ViewWriters``). They share one ``CallState`` (``_state``) and bind the parts of the
current ``Allocation`` (``_allocation``) that they use; ``_install`` hands them a new one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.attributes import (annotation_offset_property, buffer_property,
                                      carry_key, field_property, public_doc)
from mtpmeta.calls.backend import Backend
from mtpmeta.calls.carry import ChunkCarry
from mtpmeta.calls.commit_pass import CommitPass
from mtpmeta.calls.draft_loop import DraftLoop
from mtpmeta.calls.rows import RowLifecycle
from mtpmeta.calls.state import CallState
from mtpmeta.calls.writers import ViewWriters
from mtpmeta.debug.env import install_debug_checks_from_env
from mtpmeta.errors import InvalidDtypeError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.types import ForwardShape, MTPForwardMode
from mtpmeta.validation.config import check_allocate, check_config
from mtpmeta.validation.inputs import check_flag

__all__ = ["MTPMetadata"]

# Row indices of the row-lifecycle methods: whatever torch indexing of an [R] tensor
# takes. A slice, an int, a sequence of ints, a 1-D integer numpy array or tensor (a
# device tensor is read back, one sync), or a boolean mask of length R. Ints lie in
# [-R, R), as torch's.
Indices = Union[slice, int, Sequence[int], np.ndarray, Tensor]
_NONE = MTPForwardMode.NONE


class MTPMetadata:
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
        draft_annotation_offset: int in ``[0, R]``, default 0: the paused rows in front
            (draft row ``i`` is annotation row ``offset + i``); ``set_request_rows``
            sets it, and while its split lives only that value is accepted.
        request_matched_prefix_blocks, offsets, block_table, query_lengths,
            kv_lengths, row_ids, chunk_boundary_hidden: the persistent buffers
            (read-only properties, None before ``allocate``).
        chunk_boundary_valid, chunk_boundary_req_id, chunk_boundary_position: the
            chunk carry's state.
        mirror, device: the path and device ``allocate`` chose (None before it).

    Indices: the row-lifecycle methods' row indices (the module's ``Indices``).
    """

    def __init__(self, enabled: bool, max_requests: int, max_kv_block_count: int,
                 block_size_tokens: int, dummy_block_idx: int,
                 block_table_dtype: torch.dtype, hidden_size: int,
                 hidden_dtype: torch.dtype) -> None:
        state = self._state = CallState(check_flag(enabled, "enabled"))
        if state.enabled:
            check_config(max_requests, max_kv_block_count, block_size_tokens,
                         dummy_block_idx, block_table_dtype, hidden_size, hidden_dtype)
        self.max_requests = max_requests
        self.max_kv_block_count = max_kv_block_count
        self.block_size_tokens = block_size_tokens
        self.dummy_block_idx = dummy_block_idx
        self.block_table_dtype = block_table_dtype
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype
        # The allocation (born in allocate()) and the parts this object reads itself,
        # bound by _install; the kernel floor (mtpmeta.bench.floor) reads them too.
        self._allocation: Optional[Allocation] = None
        self._buffers: Optional[PersistentBuffers] = None
        self._backend: Optional[Backend] = None
        self._rows = RowLifecycle(state)
        self._carry = ChunkCarry(state)
        self._carry_state = self._carry.keys  # [3] int64, the same array for life
        self._draft = DraftLoop(state)
        self._commit = CommitPass(state)
        self._writers = ViewWriters(state)

    # ----------------------------------------------------------------- attributes
    # Fields of the shared CallState and of the draft loop, readable and assignable.
    enabled = field_property(
        "_state", "enabled",
        "Whether MTP KV caching is active (the constructor's bool); when False the "
        "object is inert.")
    last_forward = field_property(
        "_state", "last_forward",
        "``ForwardRecord`` of the last view-writing call, read by ``check_invariants`` "
        "(None before any).")
    draft_annotation_offset = annotation_offset_property(
        "int, default 0: draft row ``i`` belongs to annotation row "
        "``draft_annotation_offset + i`` (the paused-row count when paused rows come "
        "first).")
    graphed = field_property(
        "_draft", "graphed",
        "bool, the ``graphed`` of the last ``begin_decode`` (True after "
        "``begin_decode_for_capture``).")
    active_request_count = field_property("_draft", "count",
                                          "``n`` of the staged draft loop.")
    padded_count = field_property(
        "_draft", "padded", "The padded count of the staged draft loop (``>= n``).")
    active_offsets = field_property(
        "_draft", "offsets",
        "``offsets[:n]``, a view of the persistent buffer (None before "
        "``begin_decode``).")
    active_block_table = field_property(
        "_draft", "block_table",
        "``block_table[:n]``, a view (None before ``begin_decode``).")

    @property
    def forward_mode(self) -> MTPForwardMode:
        """Which MTP forward owns the attention metadata: ``NONE``, ``DRAFT`` (set by
        ``begin_decode``) or ``COMMIT`` (set by ``setup_commit_pass``). Assignable, as
        upstream's field, but only with an ``MTPForwardMode`` (a string such as
        ``"draft"`` raises ``InvalidDtypeError``, a ``TypeError``)."""
        return self._state.mode

    @forward_mode.setter
    def forward_mode(self, value: MTPForwardMode) -> None:
        if type(value) is not MTPForwardMode:
            raise InvalidDtypeError(f"forward_mode: expected an MTPForwardMode (NONE, "
                                    f"DRAFT or COMMIT), got {value!r} "
                                    f"({type(value).__name__})")
        self._state.mode = value

    @property
    def forward_active(self) -> bool:
        """Whether any MTP forward currently owns the attention metadata."""
        return self._state.mode is not _NONE

    @property
    def is_varlen_forward(self) -> bool:
        """Whether the current MTP forward has ragged per-request query lengths."""
        return self._state.mode is MTPForwardMode.COMMIT

    @property
    def mirror(self) -> Optional[bool]:
        """Read-only: True on the mirror path, False on the direct path, None unallocated."""
        backend = self._backend
        return None if backend is None else backend.mirror

    @property
    def device(self) -> Optional[torch.device]:
        """Device of the persistent buffers, or None when not allocated."""
        buffers = self._buffers
        return None if buffers is None else buffers.offsets.device

    request_matched_prefix_blocks = buffer_property(
        "request_matched_prefix_blocks",
        "[R] int32 host: leading KV blocks each row inherited from the prefix cache. "
        "None before allocate() and after deallocate() (contract §1): call "
        "allocate(device) first, then write the annotations again (allocate zeroes "
        "them, keeping the tensor, so a reference kept across stays the live one).")
    offsets = buffer_property("offsets",
                              "[R] int32 device: draft write position per request.")
    block_table = buffer_property(
        "block_table", "[R, W] block_table_dtype device: the draft loop's table.")
    query_lengths = buffer_property("query_lengths",
                                    "[R] int32 device: MHA query-length staging.")
    kv_lengths = buffer_property("kv_lengths", "[R] int32 device: MHA KV-length staging.")
    row_ids = buffer_property("row_ids", "[R] int64 device: constant 0..R-1.")
    chunk_boundary_hidden = buffer_property(
        "chunk_boundary_hidden", "[1, 1, hidden_size] device: the carried hidden.")

    chunk_boundary_valid = carry_key(0, bool, lambda v: 1 if v else 0,
                                     "Whether a chunk-boundary carry is live.")
    chunk_boundary_req_id = carry_key(1, int, None,
                                      "Request id the carry belongs to (-1 when none).")
    chunk_boundary_position = carry_key(2, int, None, "Prompt position the carried hidden "
                                        "was computed at (-1 when none).")

    def __repr__(self) -> str:
        state = "disabled" if not self.enabled else (
            "unallocated" if self._buffers is None else
            f"{'mirror' if self.mirror else 'direct'} on {self.device}")
        return (f"MTPMetadata({state}, max_requests={self.max_requests}, "
                f"max_kv_block_count={self.max_kv_block_count}, block_size_tokens="
                f"{self.block_size_tokens}, forward_mode={self._state.mode.name})")

    # Handles on the allocation for white-box tests: None without one.
    _memo = property(lambda self: None if self._allocation is None
                     else self._allocation.memo)
    _captured = property(lambda self: None if self._allocation is None
                         else self._allocation.captured)

    def _target(self, gpu_view: Any) -> ViewTarget:
        """``gpu_view`` resolved for the backends (``mtpmeta.bench.floor`` reads it)."""
        return self._allocation.memo.target(gpu_view)

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
        self._install(Allocation.create(
            max_requests=self.max_requests, max_kv_block_count=self.max_kv_block_count,
            block_size_tokens=self.block_size_tokens, dummy_block_idx=self.dummy_block_idx,
            block_table_dtype=self.block_table_dtype, hidden_size=self.hidden_size,
            hidden_dtype=self.hidden_dtype, device=device, mirror=mirror,
            max_tokens=max_tokens, staging_slots=staging_slots, kept=self._rows.kept))

    def deallocate(self) -> None:
        """Release every buffer, mirroring ``allocate`` (the suspend path). A CUDA graph
        holding a captured draft-loop setup (``capture_setup=True``) keeps the released
        buffers' addresses: recapture it after the next ``allocate``."""
        self._install(None)

    def _install(self, allocation: Optional[Allocation]) -> None:
        """Swap in an allocation (or none), with no draft loop, forward or carry.
        Fresh buffers hold no draft loop: a re-allocate mid-forward must not leave
        DRAFT pointing at views of the dropped buffers (upstream's would)."""
        if self._backend is not None:  # after every queued use (buffers.lifecycle)
            self._backend.lifecycle.retire()
        self._allocation = allocation
        self._buffers = None if allocation is None else allocation.buffers
        self._backend = None if allocation is None else allocation.backend
        for group in (self._rows, self._carry, self._draft, self._commit, self._writers):
            group.install(allocation)
        self._state.install()  # NONE, no record; a live row split ends
        if allocation is not None:  # initialised before any stream's use
            allocation.backend.lifecycle.born()

    # -------------------------------------------------------------- row lifecycle
    @public_doc(RowLifecycle.reset)
    def reset_request_rows(self, request_indexes: Indices = slice(None)) -> None:
        self._rows.reset(request_indexes)

    @public_doc(RowLifecycle.move)
    def move_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        self._rows.move(src_idxs, dst_idxs)

    @public_doc(RowLifecycle.declare_split)
    def set_request_rows(self, paused_count: int, total_count: int) -> None:
        self._rows.declare_split(self.max_requests, paused_count, total_count)

    @public_doc(RowLifecycle.swap)
    def swap_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        self._rows.swap(src_idxs, dst_idxs)

    # --------------------------------------------------------------- chunk carry
    @public_doc(ChunkCarry.invalidate)
    def invalidate_chunk_boundary(self) -> None:
        self._carry.invalidate()

    @public_doc(ChunkCarry.carry)
    def carry_chunk_boundary(self, hidden: Tensor, req_id: int, position: int) -> None:
        self._carry.carry(hidden, req_id, position)

    @public_doc(ChunkCarry.take)
    def take_chunk_boundary(self, req_id: int, seam_position: int) -> Tensor:
        return self._carry.take(req_id, seam_position)

    # ---------------------------------------------------------------- draft loop
    @public_doc(DraftLoop.begin)
    def begin_decode(self, active_request_count: int, padded_count: int,
                     start_positions: Tensor, block_table_src: Tensor,
                     graphed: bool, *, capture_setup: bool = False,
                     block_counts: Optional[Tensor] = None) -> None:
        self._draft.begin(active_request_count, padded_count, start_positions,
                          block_table_src, graphed, capture_setup, block_counts)

    @public_doc(DraftLoop.begin_for_capture)
    def begin_decode_for_capture(self, padded_count: int, *,
                                 capture_setup: bool = False) -> None:
        self._draft.begin_for_capture(padded_count, capture_setup)

    @public_doc(DraftLoop.advance)
    def advance_decode_step(self) -> None:
        self._draft.advance()

    @public_doc(DraftLoop.stage_lengths)
    def stage_decode_lengths(self) -> Tuple[Tensor, Tensor]:
        return self._draft.stage_lengths()

    @public_doc(DraftLoop.step)
    def setup_decode_step(self, gpu_view: Any) -> ForwardShape:
        return self._draft.step(gpu_view)

    @public_doc(DraftLoop.end)
    def end_forward(self) -> None:
        self._draft.end()

    # --------------------------------------------------------------- commit pass
    @public_doc(CommitPass.stage_prefill_lengths)
    def stage_prefill_lengths(self, append_counts: Tensor, pad_tokens: int) -> Tensor:
        return self._commit.stage_prefill_lengths(append_counts, pad_tokens)

    @public_doc(CommitPass.setup)
    def setup_commit_pass(self, gpu_view: Any, append_counts: Tensor, block_table: Tensor,
                          *, start_positions: Optional[Tensor] = None,
                          inherited_blocks: Optional[Tensor] = None,
                          padded_token_count: Optional[int] = None,
                          padded_request_count: Optional[int] = None,
                          block_counts: Optional[Tensor] = None,
                          device_block_table: Optional[Tensor] = None) -> ForwardShape:
        return self._commit.setup(gpu_view, append_counts, block_table, start_positions,
                                  inherited_blocks, padded_token_count,
                                  padded_request_count, block_counts, device_block_table)

    # ---------------------------------------------------------- destination view
    @public_doc(ViewWriters.write_token_maps)
    def write_token_maps(self, gpu_view: Any, rows: Tensor, positions: Tensor,
                         block_table: Tensor, padded_token_count: int,
                         inherited_blocks: Optional[Tensor] = None) -> None:
        self._writers.write_token_maps(gpu_view, rows, positions, block_table,
                                       padded_token_count, inherited_blocks)

    @public_doc(ViewWriters.write_mha_metadata)
    def write_mha_metadata(self, gpu_view: Any, query_lengths: Tensor, kv_lengths: Tensor,
                           block_table: Tensor, padded_request_count: int) -> None:
        self._writers.write_mha_metadata(gpu_view, query_lengths, kv_lengths,
                                         block_table, padded_request_count)

    # ----------------------------------------------------------------- debugging
    def check_invariants(self, gpu_view: Any = None, *,
                         request_rows: Optional[Tuple[int, int]] = None,
                         block_table: Any = None) -> None:
        """Check this object's invariants and those of the last forward's destination
        view; raises ``InvariantError`` (an ``AssertionError``, raised explicitly so it
        holds under ``python -O``) naming the broken invariant and the offending row,
        token or slot. ``gpu_view`` defaults to the view of ``last_forward`` (anything
        but a destination view is a ``ValueError``). ``request_rows=(paused, total)``:
        the scheduler's row split of the last forward, whose request ``i`` is context
        row ``paused + i``; with ``block_table``, the context's whole ``[R, W]`` table,
        every real token must write its context row's block (or the dummy block). A
        debug tool: it reads the buffers and the view back (a sync on CUDA). The list
        is in ``mtpmeta.debug.invariants``."""
        from mtpmeta.debug.invariants import check_invariants

        check_invariants(self, gpu_view, request_rows=request_rows,
                         block_table=block_table)


install_debug_checks_from_env(MTPMetadata)  # MTPMETA_DEBUG=1 wraps the public methods
