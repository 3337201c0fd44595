"""What an ``MTPMetadata`` holds between calls: the properties over its buffers and
chunk carry, the allocation it swaps in and out, and the guards its methods open with.

``MetadataState`` is the base of ``MTPMetadata`` (``mtpmeta.metadata``), which sets the
attributes in its constructor and holds the public methods (the draft loop's and the
view writers' in its mixins ``mtpmeta.calls.draft_loop`` and ``mtpmeta.calls.writers``); nothing
here validates caller input (that is ``mtpmeta.validation.checks``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.calls.backend import Backend
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.mirror.captured_route import CapturedRoute
from mtpmeta.validation.bounds import refuse_whole_annotations
from mtpmeta.validation.checks import check_decode_counts
from mtpmeta.validation.geometry import Geometry
from mtpmeta.buffers.layout import dtype_range
from mtpmeta.direct.backend import DirectBackend
from mtpmeta.errors import (ForwardModeError, InvalidDtypeError, MTPDisabledError,
                     NotAllocatedError)
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.calls.forward_memo import ForwardMemo
from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.types import ForwardRecord, MTPForwardMode

__all__ = ["MetadataState", "carry_setter", "install_debug_checks_from_env"]

_INT32 = np.dtype(np.int32)
_DRAFT = MTPForwardMode.DRAFT  # bound once: an enum member lookup costs about 1k instructions


def carry_setter(index: int, convert: Any = None) -> Any:
    """Setter of ``_carry_state[index]`` (``[valid, req_id, position]``)."""
    def setter(self: "MetadataState", value: Any) -> None:
        self._carry_state[index] = value if convert is None else convert(value)
    return setter


class MetadataState:
    """Properties and guards of ``MTPMetadata`` (see the module docstring)."""

    enabled: bool
    max_requests: int
    max_kv_block_count: int
    block_size_tokens: int
    dummy_block_idx: int
    block_table_dtype: torch.dtype
    hidden_size: int
    hidden_dtype: torch.dtype
    _forward_mode: MTPForwardMode
    active_offsets: Optional[Tensor]
    active_block_table: Optional[Tensor]
    last_forward: Optional[ForwardRecord]
    _carry_state: np.ndarray
    _buffers: Optional[PersistentBuffers]
    _backend: Optional[Backend]
    _geometry: Optional[Geometry]
    _memo: Optional[ForwardMemo]
    _active_lengths: Optional[Tuple[Tensor, Tensor]]

    # ----------------------------------------------------------------- properties
    @property
    def forward_mode(self) -> MTPForwardMode:
        """Which MTP forward owns the attention metadata: ``NONE``, ``DRAFT`` (set by
        ``begin_decode``) or ``COMMIT`` (set by ``setup_commit_pass``). Assignable, as
        upstream's field, but only with an ``MTPForwardMode`` (a string such as
        ``"draft"`` raises ``InvalidDtypeError``, a ``TypeError``)."""
        return self._forward_mode

    @forward_mode.setter
    def forward_mode(self, value: MTPForwardMode) -> None:
        if type(value) is not MTPForwardMode:
            raise InvalidDtypeError(f"forward_mode: expected an MTPForwardMode (NONE, "
                                    f"DRAFT or COMMIT), got {value!r} "
                                    f"({type(value).__name__})")
        self._forward_mode = value

    @property
    def forward_active(self) -> bool:
        """Whether any MTP forward currently owns the attention metadata."""
        return self._forward_mode is not MTPForwardMode.NONE

    @property
    def is_varlen_forward(self) -> bool:
        """Whether the current MTP forward has ragged per-request query lengths."""
        return self._forward_mode is MTPForwardMode.COMMIT

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

    def __repr__(self) -> str:
        state = "disabled" if not self.enabled else (
            "unallocated" if self._buffers is None else
            f"{'mirror' if self.mirror else 'direct'} on {self.device}")
        return (f"MTPMetadata({state}, max_requests={self.max_requests}, "
                f"max_kv_block_count={self.max_kv_block_count}, block_size_tokens="
                f"{self.block_size_tokens}, forward_mode={self._forward_mode.name})")

    def _init_state(self) -> None:
        """The private attributes of an object that holds no allocation."""
        # [3] int64: [valid, req_id, position]; the carry survives row moves (keyed by id).
        self._carry_state = np.array([0, -1, -1], dtype=np.int64)
        self._buffers = self._backend = self._geometry = self._memo = None
        self._active_lengths = None  # (query_lengths[:n], kv_lengths[:n]) in DRAFT
        self._decode_record: Optional[ForwardRecord] = None  # a draft loop's record
        # last_forward when the staged draft loop began (check_invariants' committed KV)
        self._loop_after: Optional[ForwardRecord] = None
        # (device block_table_src, n) of a device-route begin_decode, until the next
        # check_invariants compares the buffer with it (ids are not checked on the host)
        self._unchecked_table: Optional[Tuple[Tensor, int]] = None
        self._captured = None  # CapturedRoute of the allocation (mtpmeta.mirror.captured_route)
        self._capture_setup = self._offsets_stale = False  # mtpmeta.calls.captured_loop
        # mtpmeta.calls.captured_loop: the block ids every view a captured depth ran on holds,
        # and those the current captured loop's host table is known to fit.
        self._captured_ids: Optional[Tuple[int, int]] = None
        self._loop_ids: Optional[Tuple[int, int]] = None
        # mtpmeta.calls.captured_loop: padded counts prepared for capture on this allocation,
        # and on an earlier one only (a graph captured there holds freed buffers).
        self._capture_counts: Set[int] = set()
        self._orphaned_counts: Set[int] = set()

    def _allocation(self, device: torch.device, mirror: bool, max_tokens: int,
                    staging_slots: int) -> Tuple[PersistentBuffers, Backend, Geometry]:
        """New buffers on ``device``, their backend (mirror or direct) and geometry,
        under the device runtime in effect now (``mtpmeta.buffers.device_runtime``)."""
        runtime = get_runtime()
        buffers = PersistentBuffers.allocate(
            max_requests=self.max_requests, max_kv_block_count=self.max_kv_block_count,
            dummy_block_idx=self.dummy_block_idx, block_table_dtype=self.block_table_dtype,
            hidden_size=self.hidden_size, hidden_dtype=self.hidden_dtype, device=device,
            runtime=runtime)
        if mirror:
            from mtpmeta.mirror.backend import MirrorBackend

            backend = MirrorBackend(buffers, max_requests=self.max_requests,
                                    block_size=self.block_size_tokens,
                                    dummy=self.dummy_block_idx, max_tokens=max_tokens,
                                    num_slots=staging_slots, runtime=runtime)
        else:
            backend = DirectBackend(buffers, max_requests=self.max_requests,
                                    block_size=self.block_size_tokens,
                                    dummy=self.dummy_block_idx)
        return buffers, backend, Geometry(
            self.max_requests, self.max_kv_block_count, self.block_size_tokens,
            self.dummy_block_idx, self.hidden_size, self.hidden_dtype,
            buffers.offsets.device, bool(mirror), self.block_table_dtype,
            dtype_range(self.block_table_dtype), runtime)

    def _install(self, buffers: Optional[PersistentBuffers], backend: Optional[Backend],
                 geometry: Optional[Geometry]) -> None:
        """Swap in an allocation (or none), with no draft loop, forward or carry.
        Fresh buffers hold no draft loop: a re-allocate mid-forward must not leave
        DRAFT pointing at views of the dropped buffers (upstream's would)."""
        if self._backend is not None:  # every queued use of the old buffers first
            self._backend.lifecycle.retire()
        self._buffers, self._backend, self._geometry = buffers, backend, geometry
        self._memo = None if buffers is None else ForwardMemo(buffers, geometry,
                                                              backend.lifecycle)
        self._captured = None if buffers is None else CapturedRoute(
            buffers, block_size=self.block_size_tokens, dummy=self.dummy_block_idx,
            order=backend.stream_order)
        self._capture_setup = self._offsets_stale = False
        self._captured_ids = None if geometry is None else geometry.table_range
        self._loop_ids = None
        self._orphaned_counts |= self._capture_counts  # their graphs hold old buffers
        self._capture_counts = set()
        self.active_offsets = self.active_block_table = self._active_lengths = None
        self.last_forward = self._unchecked_table = None
        self._forward_mode = MTPForwardMode.NONE
        self._inherited_copy = None if buffers is None else np.zeros(
            self.max_requests, dtype=np.int64)  # [R]: a commit pass's inherited counts
        self._inherited_copy32 = None if buffers is None else np.zeros(
            self.max_requests, dtype=np.int32)  # the same for int32 counts
        # Their prefixes by length (<= R): n for the int32 scratch, -1 - n for the other.
        self._inherited_views: Dict[int, np.ndarray] = {}
        self.invalidate_chunk_boundary()
        if backend is not None:  # the fills of allocate, before a call on any stream
            backend.lifecycle.born()

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

    def _row_scratch(self, size: int) -> np.ndarray:
        scratch = self._buffers.row_scratch
        return scratch if size <= len(scratch) else np.empty(size, dtype=np.int32)

    def _enter_decode(self, active_request_count: int, padded_count: int,
                      graphed: bool) -> None:
        """Enter DRAFT mode and refresh the active views (views of fixed buffers)."""
        self._require("_enter_decode")
        count, padded = check_decode_counts(self._geometry, active_request_count,
                                            padded_count)
        self._enter_checked(count, padded, graphed)

    def _enter_checked(self, count: int, padded: int, graphed: bool) -> None:
        """``_enter_decode`` for counts the caller already validated."""
        views = self._memo.active.get(count)
        if views is None:  # views of the fixed buffers, built once per count
            views = self._memo.add_active(count)
        self.active_request_count = count
        self.padded_count = padded
        self.active_offsets, self.active_block_table, self._active_lengths = views
        self.graphed = graphed
        self._forward_mode = _DRAFT
        self._decode_record = None  # a new draft loop: its first depth makes a record
        self._loop_after = None  # begin_decode sets it after this: its last_forward
        self._capture_setup = self._offsets_stale = False  # a captured begin sets it after

    def _require_draft_views(self, method: str) -> Any:
        backend = self._require(method)
        if self.active_offsets is None:
            raise ForwardModeError(f"{method}: no draft loop is staged; call begin_decode "
                                   "first")
        if self._forward_mode is not MTPForwardMode.DRAFT:
            raise ForwardModeError(f"{method}: forward_mode is {self._forward_mode.name}, "
                                   "expected DRAFT (the draft loop ended; call "
                                   "begin_decode to start a new one)")
        return backend

    def _refuse_whole_annotations(self, method: str, inherited_blocks: Any) -> None:
        """While ``draft_annotation_offset`` is non-zero, refuse (``ValueError``,
        nothing written) ``inherited_blocks`` that is the whole annotation buffer from
        row 0 (``check_bounds.refuse_whole_annotations``); a no-op otherwise."""
        if self.draft_annotation_offset and inherited_blocks is not None:
            refuse_whole_annotations(method, inherited_blocks,
                                     self._buffers.request_matched_prefix_blocks,
                                     self.draft_annotation_offset)

    def _record_inherited(self, inherited: Any) -> Any:
        """A copy of a forward's inherited counts for ``check_invariants``, taken now:
        the caller may change its array (the annotations) before the check. Host arrays
        of at most ``R`` entries go into a preallocated ``[R]`` scratch (no allocation;
        only the last forward's record reads it), longer ones and device tensors are
        copied."""
        if inherited is None:
            return None
        if isinstance(inherited, np.ndarray):
            size = inherited.shape[0]
            # scratch[:size] of the input's dtype (a copy without a cast is cheaper)
            key = size if inherited.dtype is _INT32 else -1 - size
            copy = self._inherited_views.get(key)
            if copy is None:
                if size > self.max_requests:
                    return inherited.copy()
                scratch = self._inherited_copy if key < 0 else self._inherited_copy32
                copy = self._inherited_views[key] = scratch[:size]
            copy[...] = inherited
            return copy
        return inherited.clone()

    def _target(self, gpu_view: Any) -> ViewTarget:
        """``gpu_view`` resolved for the backends (``mtpmeta.bench.floor`` reads it too)."""
        return self._memo.target(gpu_view)


def install_debug_checks_from_env(cls: type) -> None:
    """Only when MTPMETA_DEBUG=1 at import are the public methods of ``cls`` wrapped so
    each call is followed by check_invariants. With the variable unset this costs
    nothing: no wrapper, and mtpmeta.debug.invariants is imported on first use only."""
    import os

    if os.environ.get("MTPMETA_DEBUG") == "1":
        from mtpmeta.debug.invariants import install_debug_checks

        install_debug_checks(cls)
