"""Direct path: the device is the CPU, so the numba kernels write straight into the
numpy views of the persistent buffers and of the destination view. No torch op runs.

Every method here receives inputs the wrapper (``MTPMetadata``) already validated and
converted to C-contiguous int32/int64 numpy arrays.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Tuple

import numpy as np
from mtpmeta.buffers import persistent
from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.kernels import native
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels.counted import counted_commit
from mtpmeta.kernels.entry import kernel_optional, pinned_entry

__all__ = ["DirectBackend"]

_ABSENT = kernel_optional(None)  # (placeholder, False): an optional array not given


class DirectBackend:
    """Host kernels over CPU buffers. ``host_offsets`` IS the offsets buffer here."""

    mirror = False
    stream_order = None  # the CPU: nothing is in flight, nothing to order

    def __init__(self, buffers: PersistentBuffers, *, max_requests: int, block_size: int,
                 dummy: int) -> None:
        self.buffers = buffers
        self.lifecycle = DeviceLifecycle(buffers.offsets.device)  # the CPU: no-ops
        self.max_requests = max_requests
        self.block_size = block_size
        self.dummy = dummy
        self.host_offsets = buffers.offsets.numpy()  # [R] int32
        self._draft_count = buffers.draft_count.numpy()  # [1] int32: n, for §12 graphs
        self.host_offsets_known = True
        self._block_table = buffers.block_table.numpy()  # [R, W]
        self.host_block_table = self._block_table  # the same memory, as on the mirror
        self._query_lengths = buffers.query_lengths.numpy()  # [R] int32
        self._kv_lengths = buffers.kv_lengths.numpy()  # [R] int32
        # The draft loop's block counts [R] int32: W for every row, or (after a begin
        # with the opt-in block_counts) the counts it was given.
        width = self._block_table.shape[1]
        self._full_counts = np.full(max_requests, width, dtype=np.int32)
        self._counts = np.zeros(max_requests, dtype=np.int32)
        self.host_block_counts = self._full_counts
        # [>= padded requests] int32: the counted commit's per-row record (write-only
        # there: it fills every column), kept so that a commit allocates nothing
        self._known = np.zeros(max_requests + 1, dtype=np.int32)
        # (target, decode_step's arguments after ``padded``, its pinned entry point,
        # mtpmeta.kernels.entry.pinned_entry) of the last depth's view
        self._decode_tail: Tuple[Optional[ViewTarget], tuple, Any] = (None, (), None)
        # advance_decode_step(count): the kernel's entry point bound to the offsets, so
        # each depth's advance calls compiled code with no Python frame or typing between
        self.advance_decode_step = partial(pinned_entry(
            native.draft_state.advance_offsets, (self.host_offsets, 0)), self.host_offsets)
        self._commit_tail: Tuple[Optional[ViewTarget], tuple] = (None, ())  # the same

    @property
    def named_counts(self) -> Optional[np.ndarray]:
        """The counts a draft depth's refusal names: a counted begin's, else None."""
        counts = self.host_block_counts
        return None if counts is self._full_counts else counts

    # ------------------------------------------------------------------ draft loop
    def begin_decode(self, count: int, start_positions: np.ndarray,
                     table_src: np.ndarray, block_counts: Optional[np.ndarray] = None
                     ) -> bool:
        """Stage the draft loop; False (nothing written) when a start position is
        negative or past the block table. With ``block_counts`` row ``i`` takes its
        first ``block_counts[i]`` columns and ``D`` after them."""
        if block_counts is not None:
            if not native.draft_state.copy_counted_inputs(
                    start_positions, table_src, block_counts, count, self.block_size,
                    self.dummy, self.host_offsets, self._block_table, self._counts):
                return False
            self.host_block_counts = self._counts
        elif not native.draft_state.copy_decode_inputs(start_positions, table_src, count,
                                                       self.block_size, self.host_offsets,
                                                       self._block_table):
            return False
        else:
            self.host_block_counts = self._full_counts
        persistent.stage_count(self._draft_count, count)  # a numpy write
        return True

    def begin_decode_for_capture(self, count: int) -> None:
        native.draft_state.fill_capture_state(self.host_offsets, self._block_table, count,
                                          self.dummy)
        self.host_block_counts = self._full_counts
        persistent.stage_count(self._draft_count, count)  # a numpy write


    def stage_decode_lengths(self, count: int) -> None:
        native.staging.stage_decode_lengths(self.host_offsets, count, self._query_lengths,
                                            self._kv_lengths)

    def decode_step(self, target: ViewTarget, count: int, padded: int,
                    graphed: bool) -> int:
        """One draft depth; the largest KV length, or (nothing written) -1 when an
        offset is negative or past the block table, ``-2 - i`` when row ``i`` writes a
        negative block or one past ``token_to_block_idx``."""
        tail = self._decode_tail
        if tail[0] is not target:  # per view: the kernel's arguments after padded, and
            # its entry point for their types (every argument's type is pinned: arrays
            # of this backend and of this view, Python ints; both counts arrays int32)
            args = (self.block_size, self.dummy, target.token_block_range[1],
                    self._query_lengths, self._kv_lengths, *target.token_arrays,
                    *target.request_arrays)
            tail = self._decode_tail = (target, args, pinned_entry(
                native.staging.decode_step,
                (self.host_offsets, self._block_table, self._full_counts, 0, 0, *args)))
        return tail[2](self.host_offsets, self._block_table, self.host_block_counts,
                       count, padded, *tail[1])

    # ---------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int:
        return native.staging.stage_prefill_lengths(counts, pad_tokens, self.max_requests,
                                                    self._query_lengths)

    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int, padded_requests: int,
                    block_counts: Optional[np.ndarray] = None,
                    device_table: Any = None) -> Tuple[int, int, int, int]:
        """The commit pass; ``(T, m, padded_requests, max_len)``, or (nothing written)
        ``(-code, r, column, 0)`` for a bad written block (``native.staging.commit_pass``).
        With ``block_counts``: ``mtpmeta.kernels.counted.counted_commit``. No
        ``device_table`` reaches this host path (``check_device_rows``)."""
        if block_counts is not None:
            known = self._known  # known_rows 0: every column written, known only written
            if known.shape[0] <= padded_requests:  # a view with more requests than R
                known = self._known = np.zeros(padded_requests + 1, dtype=np.int32)
            return counted_commit(
                counts, starts, table, inherited, block_counts, padded_tokens, pad_tokens,
                self.max_requests, min_padded_requests, self.block_size, self.dummy,
                self._block_table.shape[1], target.token_block_range[1],
                self._query_lengths, target.token_arrays, target.request_arrays, known, 0)
        tail = self._commit_tail
        if tail[0] is not target:  # the kernel's arguments after min_padded_requests
            tail = self._commit_tail = (target, (
                self.block_size, self.dummy, 0, self._block_table.shape[1],
                target.token_block_range[1], self._query_lengths, *target.token_arrays,
                *target.request_arrays))
        return native.staging.commit_pass(
            counts, *(_ABSENT if starts is None else (starts, True)), table,
            *(_ABSENT if inherited is None else (inherited, True)),
            padded_tokens, pad_tokens, self.max_requests, min_padded_requests, *tail[1])

    # -------------------------------------------------------------------- writers
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray,
                         positions: np.ndarray, table: np.ndarray,
                         inherited: Optional[np.ndarray], padded: int) -> None:
        native.staging.write_token_maps(
            rows, positions, table, *kernel_optional(inherited), padded, self.block_size,
            self.dummy, *target.token_arrays)

    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None:
        native.staging.write_mha_metadata(query_lengths, kv_lengths, count, table,
                                          table.shape[0], padded, self.dummy,
                                          *target.request_arrays)

    # ---------------------------------------------------------------- chunk carry
    def carry_hidden(self, source) -> None:
        """Copy ``source`` (broadcastable to ``[1, 1, H]``) into the carry buffer."""
        self.buffers.chunk_boundary_hidden.copy_(source)
