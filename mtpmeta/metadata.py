"""``MTPMetadata``: the public class. It validates every input at the boundary, then
routes the work to the direct backend (numba kernels writing CPU buffers in place) or
the mirror backend (numba staging into pinned host memory, async copies, and a few
CUDA-graph-safe torch ops on the device).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from . import native
from .backend import Backend
from .buffers import PersistentBuffers
from .checks import INT32_LIMIT, INT64_MAX, InputChecks, is_int_dtype
from .direct import DirectBackend
from .errors import (
    CarryNotAllocatedError,
    ChunkCarryError,
    ForwardModeError,
    InvalidDtypeError,
    MTPDisabledError,
    NotAllocatedError,
)
from .gpu_view import ViewCache, ViewTarget
from .runtime import get_runtime
from .inputs import (as_count, as_host_ints, as_row_indices, is_device_tensor,
                     raise_row_out_of_range)
from .types import ForwardRecord, ForwardShape, MTPForwardMode

__all__ = ["MTPMetadata"]

Indices = Union[slice, int, Tensor, np.ndarray, Any]
_TOKEN_CODES = native.staging
_DRAFT = MTPForwardMode.DRAFT
# Kernels the per-step methods call, bound once (a module attribute chain costs two
# lookups per call on the hot path).
_move_rows, _swap_rows, _reset_rows = (native.rows.move_rows, native.rows.swap_rows,
                                       native.rows.reset_rows)
_record_carry, _check_take = native.carry.record, native.carry.check_take


class MTPMetadata(InputChecks):
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
    """

    def __init__(self, enabled: bool, max_requests: int, max_kv_block_count: int,
                 block_size_tokens: int, dummy_block_idx: int,
                 block_table_dtype: torch.dtype, hidden_size: int,
                 hidden_dtype: torch.dtype) -> None:
        self.enabled = bool(enabled)
        if self.enabled:
            for name, value in (("max_requests", max_requests),
                                ("max_kv_block_count", max_kv_block_count),
                                ("block_size_tokens", block_size_tokens),
                                ("hidden_size", hidden_size)):
                as_count(value, name, low=1)
            as_count(dummy_block_idx, "dummy_block_idx", low=-2**31)
            if not isinstance(block_table_dtype, torch.dtype) or \
                    not is_int_dtype(block_table_dtype):
                raise InvalidDtypeError(f"block_table_dtype: expected an integer torch "
                                        f"dtype, got {block_table_dtype!r}")
            if not isinstance(hidden_dtype, torch.dtype) or \
                    not hidden_dtype.is_floating_point:
                raise InvalidDtypeError(f"hidden_dtype: expected a floating torch dtype, "
                                        f"got {hidden_dtype!r}")
        self.max_requests = max_requests
        self.max_kv_block_count = max_kv_block_count
        self.block_size_tokens = block_size_tokens
        self.dummy_block_idx = dummy_block_idx
        self.block_table_dtype = block_table_dtype
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype

        self.forward_mode: MTPForwardMode = MTPForwardMode.NONE
        self.graphed: bool = False
        self.active_request_count: int = 0
        self.padded_count: int = 0
        self.active_offsets: Optional[Tensor] = None  # offsets[:n] view
        self.active_block_table: Optional[Tensor] = None  # block_table[:n] view
        # [3] int64: [valid, req_id, position]; the carry survives row moves (keyed by id).
        self._carry_state = np.array([0, -1, -1], dtype=np.int64)
        self._buffers: Optional[PersistentBuffers] = None
        self._backend: Optional[Backend] = None
        self._views = ViewCache()
        # The last resolved view: (weakref to it, its target). A step resolves the same
        # view 4 times; this skips the cache's lookup, its weakref and bound-method setup.
        self._last_view: Optional[Tuple[Any, ViewTarget]] = None
        self._prefill_views: Dict[int, Tensor] = {}
        self._active_views: Dict[int, Tuple[Tensor, Tensor, Tuple[Tensor, Tensor]]] = {}
        self._active_lengths: Optional[Tuple[Tensor, Tensor]] = None
        self._shapes: Dict[Tuple[Any, ...], ForwardShape] = {}
        # The last view-writing call, for check_invariants (None before any).
        self.last_forward: Optional[ForwardRecord] = None
        self._decode_record: Optional[ForwardRecord] = None
        # Annotation row of draft row 0, for check_invariants only: draft row i belongs
        # to request_matched_prefix_blocks[draft_annotation_offset + i] (the active
        # slice; set it to the paused-row count when paused rows come first).
        self.draft_annotation_offset: int = 0

    # ----------------------------------------------------------------- properties
    @property
    def forward_active(self) -> bool:
        """Whether any MTP forward currently owns the attention metadata."""
        return self.forward_mode is not MTPForwardMode.NONE

    @property
    def is_varlen_forward(self) -> bool:
        """Whether the current MTP forward has ragged per-request query lengths."""
        return self.forward_mode is MTPForwardMode.COMMIT

    @property
    def mirror(self) -> Optional[bool]:
        """Read-only: True on the mirror path, False on the direct path, None unallocated."""
        return None if self._backend is None else self._backend.mirror

    @property
    def device(self) -> Optional[torch.device]:
        """Device of the persistent buffers, or None when not allocated."""
        return None if self._buffers is None else self._buffers.offsets.device

    def _buffer(self, name: str) -> Optional[Tensor]:
        return None if self._buffers is None else getattr(self._buffers, name)

    request_matched_prefix_blocks = property(
        lambda self: self._buffer("request_matched_prefix_blocks"),
        doc="[R] int32 host: leading KV blocks each row inherited from the prefix cache.")
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

    @property
    def chunk_boundary_valid(self) -> bool:
        """Whether a chunk-boundary carry is live."""
        return bool(self._carry_state[0])

    @chunk_boundary_valid.setter
    def chunk_boundary_valid(self, value: bool) -> None:
        self._carry_state[0] = 1 if value else 0

    @property
    def chunk_boundary_req_id(self) -> int:
        """Request id the carry belongs to (-1 when none)."""
        return int(self._carry_state[1])

    @chunk_boundary_req_id.setter
    def chunk_boundary_req_id(self, value: int) -> None:
        self._carry_state[1] = value

    @property
    def chunk_boundary_position(self) -> int:
        """Prompt position the carried hidden was computed at (-1 when none)."""
        return int(self._carry_state[2])

    @chunk_boundary_position.setter
    def chunk_boundary_position(self, value: int) -> None:
        self._carry_state[2] = value

    def __repr__(self) -> str:
        state = "disabled" if not self.enabled else (
            "unallocated" if self._buffers is None else
            f"{'mirror' if self.mirror else 'direct'} on {self.device}")
        return (f"MTPMetadata({state}, max_requests={self.max_requests}, "
                f"max_kv_block_count={self.max_kv_block_count}, block_size_tokens="
                f"{self.block_size_tokens}, forward_mode={self.forward_mode.name})")

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, device: Union[torch.device, str], *,
                 mirror: Optional[bool] = None, max_tokens: int = 16384,
                 staging_slots: int = 4) -> None:
        """Reserve the persistent buffers (and the host staging). No-op when disabled.

        Args:
            device: device of the GPU-resident buffers.
            mirror: ``None`` mirrors exactly when ``device`` is not the CPU; ``True``
                forces the mirror path (pinned staging + async copies + device ops) on
                any device, the CPU included; ``False`` demands a CPU device.
            max_tokens: token capacity the mirror path's forward staging is sized for
                (tokens one ``write_token_maps``/commit pass writes). A larger forward
                re-sizes the staging once, outside the draft loop (which stages at most
                ``max_requests`` tokens). Unused on the direct path.
            staging_slots: pinned slots per staging ring on the mirror path: how many
                staged forwards the host may run ahead of the device before a fence
                wait stalls it (see README "Mirror path costs"). Unused on the direct
                path.

        The device runtime (streams, events, pinned memory; ``mtpmeta.runtime``) in
        effect now is the one these buffers use for their lifetime.
        """
        if not self.enabled:
            return
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as error:
            raise ValueError(f"allocate: device {device!r} is not a torch device "
                             f"({error})") from None
        if mirror is None:
            mirror = device.type != "cpu"
        elif not mirror and device.type != "cpu":
            raise ValueError(f"allocate: mirror=False needs a CPU device, got {device}")
        as_count(max_tokens, "max_tokens", low=1, high=INT32_LIMIT - 1,
                 high_name="int32 token index limit")
        as_count(staging_slots, "staging_slots", low=2, high=64, high_name="slot limit")
        runtime = get_runtime()
        buffers = PersistentBuffers.allocate(
            max_requests=self.max_requests, max_kv_block_count=self.max_kv_block_count,
            dummy_block_idx=self.dummy_block_idx, block_table_dtype=self.block_table_dtype,
            hidden_size=self.hidden_size, hidden_dtype=self.hidden_dtype, device=device,
            runtime=runtime)
        if mirror:
            from .mirror import MirrorBackend

            backend = MirrorBackend(buffers, max_requests=self.max_requests,
                                    block_size=self.block_size_tokens,
                                    dummy=self.dummy_block_idx, max_tokens=max_tokens,
                                    num_slots=staging_slots, runtime=runtime)
        else:
            backend = DirectBackend(buffers, max_requests=self.max_requests,
                                    block_size=self.block_size_tokens,
                                    dummy=self.dummy_block_idx)
        self._buffers = buffers
        self._backend = backend
        self._clear_active()
        self._views.clear()
        self._last_view = None
        self._prefill_views = {}
        self._active_views = {}
        self.last_forward = None
        # Fresh buffers hold no draft loop: a re-allocate mid-forward must not leave
        # DRAFT pointing at views of the dropped buffers (upstream's would).
        self.forward_mode = MTPForwardMode.NONE
        self.invalidate_chunk_boundary()

    def deallocate(self) -> None:
        """Release every buffer, mirroring ``allocate`` (the suspend path)."""
        self._buffers = None
        self._backend = None
        self._clear_active()
        self._views.clear()
        self._last_view = None
        self._prefill_views = {}
        self._active_views = {}
        self.last_forward = None
        self.forward_mode = MTPForwardMode.NONE
        self.invalidate_chunk_boundary()

    def _clear_active(self) -> None:
        self.active_offsets = None
        self.active_block_table = None
        self._active_lengths = None

    def _require(self, method: str) -> Any:
        """The backend, or a clear error: disabled object, or not allocated."""
        backend = self._backend
        if backend is None:
            if not self.enabled:
                raise MTPDisabledError(f"{method}: this MTPMetadata was built with "
                                       "enabled=False and holds no buffers")
            raise NotAllocatedError(f"{method}: buffers are not allocated; call "
                                    "allocate(device) first")
        return backend

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

    def _row_pair(self, method: str, src_idxs: Indices,
                  dst_idxs: Indices) -> Tuple[np.ndarray, np.ndarray]:
        src = as_row_indices(src_idxs, self.max_requests, "src_idxs")
        dst = as_row_indices(dst_idxs, self.max_requests, "dst_idxs")
        if type(src) is slice:
            src = np.arange(self.max_requests)[src]
        if type(dst) is slice:
            dst = np.arange(self.max_requests)[dst]
        if len(src) != len(dst):
            raise ValueError(f"{method}: src_idxs has {len(src)} rows but dst_idxs "
                             f"has {len(dst)}; they must have the same length")
        return src, dst

    def _row_scratch(self, size: int) -> np.ndarray:
        scratch = self._buffers.row_scratch
        return scratch if size <= len(scratch) else np.empty(size, dtype=np.int32)

    def move_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        """``x[dst] = x[src]``: every source is read before any destination is written,
        so overlapping ranges are safe; sources keep their values. No-op when disabled."""
        if not self.enabled:
            return
        buffers = self._buffers
        if buffers is None:
            self._require("move_request_rows")
        src, dst = self._row_pair("move_request_rows", src_idxs, dst_idxs)
        scratch = buffers.row_scratch
        if len(src) > len(scratch):
            scratch = self._row_scratch(len(src))
        bad = _move_rows(buffers.annotations, src, dst, scratch)
        if bad >= 0:
            self._raise_bad_row(src, dst, bad)

    def swap_request_rows(self, src_idxs: Indices, dst_idxs: Indices) -> None:
        """Swap annotations: both sides read first, then ``x[dst] = old[src]``, then
        ``x[src] = old[dst]`` (an index on both sides keeps the second assignment).
        No-op when disabled."""
        if not self.enabled:
            return
        buffers = self._buffers
        if buffers is None:
            self._require("swap_request_rows")
        src, dst = self._row_pair("swap_request_rows", src_idxs, dst_idxs)
        scratch = buffers.row_scratch
        if 2 * len(src) > len(scratch):
            scratch = self._row_scratch(2 * len(src))
        bad = _swap_rows(buffers.annotations, src, dst, scratch)
        if bad >= 0:
            self._raise_bad_row(src, dst, bad)

    def _raise_bad_row(self, src: np.ndarray, dst: np.ndarray, bad: int) -> None:
        """``bad`` from a pair kernel: -1, or the index it refused (nothing written)."""
        if bad >= 0:
            count = src.shape[0]
            if bad < count:
                raise_row_out_of_range(src, bad, self.max_requests, "src_idxs")
            raise_row_out_of_range(dst, bad - count, self.max_requests, "dst_idxs")

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
        req_id = as_count(req_id, "req_id", high=INT64_MAX, high_name="int64 max")
        position = as_count(position, "position", high=INT64_MAX, high_name="int64 max")
        if not isinstance(hidden, torch.Tensor):
            try:
                hidden = torch.as_tensor(hidden)
            except (RuntimeError, TypeError, ValueError) as error:
                raise InvalidDtypeError(f"hidden: expected a tensor with hidden_size "
                                        f"{self.hidden_size} elements ({error})") from None
        if hidden.is_meta:
            raise ValueError("hidden: a meta tensor holds no data to carry")
        if not hidden.dtype.is_floating_point:
            raise InvalidDtypeError(f"hidden: dtype {hidden.dtype} is not a floating dtype "
                                    f"(expected {self.hidden_dtype})")
        if hidden.numel() != self.hidden_size:
            raise ValueError(f"hidden: {hidden.numel()} elements (shape "
                             f"{tuple(hidden.shape)}), expected hidden_size "
                             f"{self.hidden_size}")
        # [H], [1, H] and [1, 1, H] (H elements, last dim H) broadcast into the buffer as
        # they are; other shapes with H elements are reshaped first.
        source = hidden if 0 < hidden.dim() <= 3 and hidden.size(-1) == self.hidden_size \
            else hidden.reshape(self._buffers.chunk_boundary_hidden.shape)
        if source.requires_grad:
            source = source.detach()  # never let the persistent buffer join a graph
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
        req_id = as_count(req_id, "req_id", low=-INT64_MAX - 1, high=INT64_MAX,
                          high_name="int64 max")
        seam_position = as_count(seam_position, "seam_position", low=-INT64_MAX - 1,
                                 high=INT64_MAX, high_name="int64 max")
        code = _check_take(self._carry_state, req_id, seam_position)
        if code == native.carry.CARRY_NOT_VALID:
            raise ChunkCarryError(
                f"take_chunk_boundary: no live chunk-boundary carry (chunk_boundary_valid "
                f"is False), but request {req_id} asked for one at position "
                f"{seam_position}")
        if code == native.carry.CARRY_OTHER_REQUEST:
            raise ChunkCarryError(
                f"take_chunk_boundary: the carry belongs to request "
                f"{self.chunk_boundary_req_id}, not request {req_id}")
        if code == native.carry.CARRY_OTHER_POSITION:
            raise ChunkCarryError(
                f"take_chunk_boundary: the carry for request {req_id} sits at position "
                f"{self.chunk_boundary_position}, but the seam is at {seam_position}")
        return self._buffers.chunk_boundary_hidden

    # ---------------------------------------------------------------- draft loop
    def begin_decode(self, active_request_count: int, padded_count: int,
                     start_positions: Tensor, block_table_src: Tensor,
                     graphed: bool) -> None:
        """Stage the draft loop: copy (never alias) ``start_positions[:n]`` into
        ``offsets[:n]`` and ``block_table_src[:n]`` into ``block_table[:n]``; enter DRAFT.

        start_positions: int [>= n] (tensor, array or sequence); block_table_src:
        int [>= n, max_kv_block_count]. Device tensors (mirror path) are copied on the
        device and are not value-checked (that would be a sync); the host then has no
        copy of the offsets and ``ForwardShape.max_seqlen_k`` is None.
        """
        backend = self._backend
        if backend is None:
            backend = self._require("begin_decode")
        count = as_count(active_request_count, "active_request_count",
                         high=self.max_requests, high_name="max_requests")
        padded = self._padded_request_slots(padded_count, count)
        if backend.mirror and (is_device_tensor(start_positions)
                               or is_device_tensor(block_table_src)):
            self._check_device_decode_inputs(start_positions, block_table_src, count)
            backend.begin_decode_device(count, start_positions, block_table_src)
        else:
            starts = as_host_ints(start_positions, "start_positions")
            table = as_host_ints(block_table_src, "block_table_src", ndim=2)
            self._check_decode_shapes(starts, table, count)
            if not backend.begin_decode(count, starts, table):  # bad start: nothing written
                self._raise_position_error("start_positions", starts, count)
        self._enter_checked(count, padded, graphed)

    def begin_decode_for_capture(self, padded_count: int) -> None:
        """Scratch-only draft state for CUDA-graph capture: ``offsets[:p] = 0``,
        ``block_table[:p] = D``, then DRAFT with ``n = p`` and ``graphed=True``."""
        if not self.enabled:
            raise MTPDisabledError("begin_decode_for_capture: MTP KV caching is disabled "
                                   "(enabled=False)")
        backend = self._require("begin_decode_for_capture")
        padded = self._padded_request_slots(padded_count, 0)
        backend.begin_decode_for_capture(padded)
        self._enter_checked(padded, padded, True)

    def _enter_decode(self, active_request_count: int, padded_count: int,
                      graphed: bool) -> None:
        """Enter DRAFT mode and refresh the active views (views of fixed buffers)."""
        self._require("_enter_decode")
        count = as_count(active_request_count, "active_request_count",
                         high=self.max_requests, high_name="max_requests")
        self._enter_checked(count, self._padded_request_slots(padded_count, count), graphed)

    def _enter_checked(self, count: int, padded: int, graphed: bool) -> None:
        """``_enter_decode`` for counts the caller already validated."""
        views = self._active_views.get(count)
        if views is None:  # views of the fixed buffers, built once per count
            buffers = self._buffers
            views = (buffers.offsets[:count], buffers.block_table[:count],
                     (buffers.query_lengths[:count], buffers.kv_lengths[:count]))
            self._active_views[count] = views
        self.active_request_count = count
        self.padded_count = padded
        self.active_offsets, self.active_block_table, self._active_lengths = views
        self.graphed = bool(graphed)
        self.forward_mode = MTPForwardMode.DRAFT
        self._decode_record = None  # a new draft loop: its first depth makes a record

    def _require_draft_views(self, method: str) -> Any:
        backend = self._require(method)
        if self.active_offsets is None:
            raise ForwardModeError(f"{method}: no draft loop is staged; call begin_decode "
                                   "first")
        return backend

    def advance_decode_step(self) -> None:
        """Advance every active request's write position by one, in place (device
        buffer and host copy alike)."""
        backend = self._backend
        if backend is None or self.active_offsets is None:
            backend = self._require_draft_views("advance_decode_step")
        backend.advance_decode_step(self.active_request_count)

    def end_forward(self) -> None:
        """Leave MTP-forward mode; nothing else changes."""
        self.forward_mode = MTPForwardMode.NONE

    def stage_decode_lengths(self) -> Tuple[Tensor, Tensor]:
        """Stage one draft depth's MHA lengths: query 1, KV ``active_offsets + 1``.

        Returns views of ``query_lengths[:n]`` and ``kv_lengths[:n]``.
        """
        backend = self._require_draft_views("stage_decode_lengths")
        backend.stage_decode_lengths(self.active_request_count)
        return self._active_lengths

    def setup_decode_step(self, gpu_view: Any) -> ForwardShape:
        """One draft depth in one call: token maps for rows ``0..n-1`` at
        ``active_offsets`` through ``active_block_table`` padded to ``padded_count``,
        ``stage_decode_lengths``, and MHA metadata padded to ``padded_count``.

        Needs DRAFT mode. Returns the launch shape, computed on the host: no sync.
        ``max_seqlen_q`` is 1; ``max_seqlen_k`` is ``max_kv_block_count *
        block_size_tokens`` for a graphed loop (the capture-time bound, so a captured
        kernel's launch bounds never change), else the largest KV length (at least 1),
        or None after ``begin_decode`` got device-tensor start positions.

        On the mirror path every depth, eager or graphed, reads the host copy of the
        offsets and block table that ``begin_decode`` staged (and
        ``advance_decode_step`` keeps), so an in-place edit of ``active_offsets`` / ``active_block_table`` does not reach it;
        call ``begin_decode`` again instead. The direct path reads the buffers and
        sees such an edit.
        """
        backend = self._backend
        if backend is None or self.active_offsets is None:
            backend = self._require_draft_views("setup_decode_step")
        if self.forward_mode is not _DRAFT:
            raise ForwardModeError(f"setup_decode_step: forward_mode is "
                                   f"{self.forward_mode.name}, expected DRAFT (call "
                                   "begin_decode first)")
        target = self._target(gpu_view)
        count, padded = self.active_request_count, self.padded_count
        if padded > target.max_tokens or padded > target.max_requests or \
                target.width != self.max_kv_block_count:
            self._check_view_capacity(target, tokens=padded, requests=padded)
            self._check_view_width(target, self.max_kv_block_count, "max_kv_block_count")
        max_kv = backend.decode_step(target, count, padded, self.graphed)
        if max_kv < 0:  # the kernel found a bad offset and wrote nothing
            self._raise_position_error("active_offsets", backend.host_offsets, count)
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
        return self._shape(count, padded, count, padded, 1, max_k)

    def _shape(self, *fields: Any) -> ForwardShape:
        """``ForwardShape(*fields)``, built once per distinct shape (shapes repeat step
        after step, and building a frozen dataclass costs about 1 µs)."""
        shape = self._shapes.get(fields)
        if shape is None:
            if len(self._shapes) > 4096:
                self._shapes.clear()
            shape = ForwardShape(*fields)
            self._shapes[fields] = shape
        return shape

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
        pad = as_count(pad_tokens, "pad_tokens", high=INT32_LIMIT - 1,
                       high_name="int32 length limit")
        if is_device_tensor(append_counts) and backend.mirror:
            counts = self._check_device_counts(append_counts)
            staged = backend.stage_prefill_lengths_device(counts, pad)
        else:
            counts = self._host_counts(append_counts, "append_counts")
            staged = backend.stage_prefill_lengths(counts, pad)
        return self._prefill_view(staged)

    def _prefill_view(self, length: int) -> Tensor:
        view = self._prefill_views.get(length)
        if view is None:
            view = self._buffers.query_lengths[:length]
            self._prefill_views[length] = view
        return view

    def setup_commit_pass(self, gpu_view: Any, append_counts: Tensor, block_table: Tensor,
                          *, start_positions: Optional[Tensor] = None,
                          inherited_blocks: Optional[Tensor] = None,
                          padded_token_count: Optional[int] = None,
                          padded_request_count: Optional[int] = None) -> ForwardShape:
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
        array, which with paused rows redirects the wrong requests.

        Attention output: KV length equals query length (a fresh causal prefill), so
        it is meaningful only for spans starting at position 0; later spans populate
        KV. ``ForwardShape.max_seqlen_q == max_seqlen_k`` is the largest staged length
        (at least 1). When ``P == R`` and there is token padding, request ``P - 1``
        absorbs the pad rows and its KV span runs past what it writes: its
        ``mha_block_table`` columns that lie wholly at or past ``start + count`` point at
        the dummy block (upstream copies the caller's row, -1 entries included).
        Example: BS 4, R 2, counts [3, 3], tables [[0, -1], [1, -1]], 8 tokens ->
        lengths [3, 5], request 1 reads row [1, D].
        """
        backend = self._require("setup_commit_pass")
        target = self._target(gpu_view)
        counts = self._host_counts(append_counts, "append_counts")
        num_prefill = counts.shape[0]
        table = as_host_ints(block_table, "block_table", ndim=2)
        if table.shape[0] < num_prefill:
            raise ValueError(f"block_table: {table.shape[0]} rows < {num_prefill} requests "
                             "(append_counts)")
        self._check_view_width(target, table.shape[1], "block_table width")
        starts = self._optional_per_request(start_positions, "start_positions", num_prefill)
        inherited = self._optional_per_request(inherited_blocks, "inherited_blocks",
                                               num_prefill)
        columns = min(self.max_kv_block_count, table.shape[1])
        code, culprit, total, _ = native.staging.check_commit_inputs(
            counts, starts if starts is not None else counts, starts is not None, columns,
            self.block_size_tokens)
        if code == _TOKEN_CODES.NEGATIVE_POSITION:
            raise ValueError(f"start_positions: negative position {int(starts[culprit])} "
                             f"at index {culprit}")
        if code == _TOKEN_CODES.BLOCK_COLUMN_TOO_LARGE:
            start = 0 if starts is None else int(starts[culprit])
            self._check_block_column(
                f"start_positions/append_counts (request {culprit})",
                start + int(counts[culprit]) - 1, columns)
        if total > target.max_tokens:
            raise ValueError(f"append_counts: {total} tokens > max_tokens "
                             f"{target.max_tokens} of gpu_view")
        padded_tokens = total if padded_token_count is None else as_count(
            padded_token_count, "padded_token_count", high=target.max_tokens,
            high_name="gpu_view max_tokens")
        if padded_tokens < total:
            raise ValueError(f"padded_token_count: {padded_tokens} < total append_counts "
                             f"{total}")
        pad = padded_tokens - total
        staged = num_prefill + 1 if pad > 0 and num_prefill < self.max_requests \
            else num_prefill
        min_padded = num_prefill if padded_request_count is None else as_count(
            padded_request_count, "padded_request_count")
        if min_padded < num_prefill:
            raise ValueError(f"padded_request_count: {min_padded} < number of requests "
                             f"{num_prefill} (append_counts)")
        padded_requests = max(min_padded, staged)
        self._check_view_capacity(target, requests=padded_requests)
        staged, padded_requests, max_len = backend.commit_pass(
            target, counts, starts, table, inherited, padded_tokens, pad, min_padded,
            padded_requests)
        self.forward_mode = MTPForwardMode.COMMIT
        self.last_forward = ForwardRecord("commit", gpu_view, int(total), padded_tokens,
                                          staged, padded_requests, inherited)
        max_len = max(int(max_len), 1)  # upstream floors an empty forward at 1
        return self._shape(int(total), padded_tokens, staged, padded_requests, max_len,
                           max_len)

    # -------------------------------------------------------------------- writers
    def _target(self, gpu_view: Any) -> ViewTarget:
        last = self._last_view
        if last is not None and last[0]() is gpu_view and last[1].still_matches(gpu_view):
            return last[1]
        target = self._views.resolve(gpu_view, self._accept_view)
        try:
            self._last_view = (weakref.ref(gpu_view), target)
        except TypeError:  # no weak references to this view type: resolve every time
            self._last_view = None
        return target

    def _accept_view(self, target: ViewTarget) -> None:
        if target.device != self.device:
            raise ValueError(f"gpu_view: fields on {target.device}, but buffers were "
                             f"allocated on {self.device}")

    def write_token_maps(self, gpu_view: Any, rows: Tensor, positions: Tensor,
                         block_table: Tensor, padded_token_count: int,
                         inherited_blocks: Optional[Tensor] = None) -> None:
        """Write the per-token KV destination maps for ``T = len(positions)`` tokens.

        ``col = positions // BS``; block ``D`` when ``col < inherited_blocks[rows]``,
        else ``block_table[rows, col]``; local ``positions % BS``; request ``rows``;
        both position fields ``positions``. Pad rows ``[T, padded_token_count)`` get
        block ``D`` and local 0 and nothing else. rows, positions: int [T];
        block_table: int [B, >= cols]; inherited_blocks: int [> max(rows)].
        """
        backend = self._require("write_token_maps")
        target = self._target(gpu_view)
        inputs = (rows, positions, block_table, inherited_blocks)
        if backend.mirror and any(is_device_tensor(x) for x in inputs):
            count = self._check_device_token_inputs(rows, positions, block_table,
                                                    inherited_blocks)
            padded = self._padded_tokens(padded_token_count, count, target)
            backend.write_token_maps_device(target, rows, positions, block_table,
                                            inherited_blocks, padded)
            self.last_forward = ForwardRecord("tokens", gpu_view, count, padded, 0, 0,
                                              inherited_blocks)
            return
        rows_np = as_host_ints(rows, "rows")
        positions_np = as_host_ints(positions, "positions")
        table = as_host_ints(block_table, "block_table", ndim=2)
        inherited = None if inherited_blocks is None else as_host_ints(
            inherited_blocks, "inherited_blocks")
        count = positions_np.shape[0]
        if rows_np.shape[0] != count:
            raise ValueError(f"rows: {rows_np.shape[0]} entries, positions: {count}; they "
                             "must have the same length")
        padded = self._padded_tokens(padded_token_count, count, target)
        columns = min(self.max_kv_block_count, table.shape[1])
        code, culprit = native.staging.check_token_inputs(
            rows_np, positions_np, table.shape[0],
            0 if inherited is None else inherited.shape[0], inherited is not None,
            columns, self.block_size_tokens)
        if code != _TOKEN_CODES.TOKENS_OK:
            self._raise_token_error(code, culprit, rows_np, positions_np, table, inherited,
                                    columns)
        backend.write_token_maps(target, rows_np, positions_np, table, inherited, padded)
        self.last_forward = ForwardRecord("tokens", gpu_view, count, padded, 0, 0, inherited)

    def write_mha_metadata(self, gpu_view: Any, query_lengths: Tensor, kv_lengths: Tensor,
                           block_table: Tensor, padded_request_count: int) -> None:
        """Write the per-request MHA read metadata for ``n = len(query_lengths)``.

        Lengths and running sums for slots ``< n``; block rows ``< B`` from
        ``block_table`` and ``[B, n)`` all ``D``; padded slots ``[n,
        padded_request_count)`` get zero lengths, flat sums and -1 rows.
        ``kv_lengths`` may be the very same tensor as ``query_lengths``.
        """
        backend = self._require("write_mha_metadata")
        target = self._target(gpu_view)
        inputs = (query_lengths, kv_lengths, block_table)
        if backend.mirror and any(is_device_tensor(x) for x in inputs):
            count = self._check_device_mha_inputs(target, query_lengths, kv_lengths,
                                                  block_table)
            padded = self._padded_requests(padded_request_count, count, target)
            backend.write_mha_metadata_device(target, query_lengths, kv_lengths, count,
                                              block_table, padded)
            self.last_forward = ForwardRecord("mha", gpu_view, 0, 0, count, padded)
            return
        q = as_host_ints(query_lengths, "query_lengths")
        kv = q if kv_lengths is query_lengths else as_host_ints(kv_lengths, "kv_lengths")
        table = as_host_ints(block_table, "block_table", ndim=2)
        count = q.shape[0]
        self._check_mha_shapes(target, count, kv.shape[0], tuple(table.shape))
        for name, lengths in (("query_lengths", q), ("kv_lengths", kv)):
            bad = native.checks.first_outside(lengths, 0, INT32_LIMIT)
            if bad >= 0:
                kind = "negative length" if lengths[bad] < 0 else "length beyond int32"
                raise ValueError(f"{name}: {kind} {int(lengths[bad])} at index {bad}")
        padded = self._padded_requests(padded_request_count, count, target)
        backend.write_mha_metadata(target, q, kv, count, table, padded)
        self.last_forward = ForwardRecord("mha", gpu_view, 0, 0, count, padded)

    # ----------------------------------------------------------------- debugging
    def check_invariants(self, gpu_view: Any = None) -> None:
        """Check this object's invariants and those of the last forward's destination
        view.

        Raises ``InvariantError`` (an ``AssertionError``, raised explicitly so it holds
        under ``python -O``) naming the broken invariant and the offending row, token or
        slot. ``gpu_view`` defaults to the view of ``last_forward``. A debug tool: it
        reads the buffers and the view back (a sync on CUDA). The list is in
        ``mtpmeta.invariants``.
        """
        from .invariants import check_invariants

        check_invariants(self, gpu_view)

# --- debug checks (mtpmeta.invariants) ---
# Only when MTPMETA_DEBUG=1 at import are the public methods wrapped so each call is
# followed by check_invariants. With the variable unset this costs nothing: no wrapper,
# and mtpmeta.invariants is imported on first use only.
def _install_debug_checks_from_env() -> None:
    import os

    if os.environ.get("MTPMETA_DEBUG") == "1":
        from .invariants import install_debug_checks

        install_debug_checks(MTPMetadata)


_install_debug_checks_from_env()
# --- end debug checks (mtpmeta.invariants) ---
