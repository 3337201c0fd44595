"""``MirrorBackend``: the mirror path's entry points. Numba kernels stage into pinned
host slots, async copies land in persistent device buffers, and a few small torch ops
write the destination view.

The backend holds the host truth of the draft state and one object per buffer set,
and dispatches each call to them by name:

* ``begin`` (``BeginStaging``): a begin's pinned slots, its private device landing and
  the commit pass's reuse of the landed rows;
* ``forward`` (``ForwardStaging``): the forward ring, the fixed stages of draft depths
  and commit passes, and the per-shape shadow route of the writers;
* ``counted`` (``CountedRoute``): the begin and commit pass with block counts, given
  or derived from a wide table;
* ``prefill_lengths`` and ``carry`` (``host_inputs``): the small inputs' own rings;
* ``device_route`` (``DeviceRoute``): inputs that are already device tensors (its
  draft loop is planned at ``begin_decode``, ``device_draft_plan``).

Each staged call is a plan step (the kernel writes a pinned slot: host work only)
then a run step (one H2D copy into the slot's device stage or the shared zone, then
a few device copies into the view); the slot's fence is recorded after the last op
that reads it, so neither the pinned slot nor its device stage is rewritten while
such an op may still be pending, on any stream.

Host truth, device snapshot: ``host_offsets`` / ``host_block_table`` /
``host_block_counts`` are the host's own copy of the draft state (so validation and
``ForwardShape`` need no read-back); the device buffers are fixed-address snapshots.
``host_block_table`` is the pinned begin slot the loop's begin staged (whole ``[R, W]``
rows, or a counted begin's packed ``[n, C]`` rows): a slot is only rewritten by a
later begin, which re-points it first, so the table is copied on the host once per
draft loop.

``graphed=True`` means the MTP forward that follows replays a captured graph reading
the view's fixed addresses; the setup itself runs here, eagerly, before each replay.
Every call that stages refuses to run while a capture is underway on the device, as far
as the runtime sees (``GraphCaptureError``): captured, it would bake a pinned slot and
the captured request count into the graph and leave the host's draft state behind the
device's; and a fence's event query during another stream's global-mode capture would
invalidate that capture.

Streams: the persistent buffers (offsets, block table, query/KV lengths, the carry, the
begin landing and the forward ring's zone) are one state. Every call that writes or
reads them first orders itself after the previous such call when the current stream
changed (``StreamOrder``: an event recorded on the previous stream, waited on by the
current one), so a pass on stream B never rewrites a length that a forward issued on
stream A has yet to read, nor the zone a depth or pass on stream A has yet to place
from. View writers touch only the caller's view, their own slot's stage and the view's
own device scratch (``ViewTarget.writer_scratch``), and are not ordered. Caller device
tensors that queued work reads get ``record_stream`` on the current stream through the
runtime, so a producer that allocated them on another stream may free them at once.

Cost in device data ops: 1 per carry, 2 per plain begin, 2 per depth, 1 per advance,
2 per commit pass (3 with the caller's device copy of its rows): 14 per standard step
of 3 depths, advances included.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.device_runtime import DeviceRuntime, StreamOrder, get_runtime
from mtpmeta.buffers.layout import numpy_dtype
from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.errors import GraphCaptureError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels import native
from mtpmeta.kernels.entry import kernel_optional
from mtpmeta.mirror.begin_staging import BeginStaging
from mtpmeta.mirror.counted import CountedRoute, derives, packed_refusal
from mtpmeta.mirror.device_route import DeviceRoute
from mtpmeta.mirror.forward_staging import ForwardStaging
from mtpmeta.mirror.host_inputs import CarryStaging, PrefillLengthsStaging

__all__ = ["MirrorBackend"]


class MirrorBackend:
    """The mirror path (module docstring). Host truth: ``host_offsets`` ``[R]`` int32,
    ``host_block_table`` (``[R, W]`` of the table dtype, or packed ``[n, C]`` rows),
    ``host_block_counts`` ``[R]`` int32 (``W`` for every row without counts),
    ``host_offsets_known`` (False after a device-route begin) and ``begin_derived``
    (the last begin took counts derived from its table).

    Invariant: while ``host_offsets_known``, rows ``[:n]`` of the host truth equal what
    ``offsets`` and ``block_table`` hold once the ops issued so far ran (a begin
    writes both sides from one pinned slot, an advance moves both), so no call reads
    the device back; every call that stages enters ``refuse_capture`` first."""

    mirror = True

    def __init__(self, buffers: PersistentBuffers, *, max_requests: int, block_size: int,
                 dummy: int, max_tokens: int, num_slots: int = 8,
                 runtime: Optional[DeviceRuntime] = None) -> None:
        runtime = self.runtime = runtime if runtime is not None else get_runtime()
        self.buffers = buffers
        self.max_requests = max_requests
        self.block_size = block_size
        self.dummy = dummy
        self.device = buffers.offsets.device
        width = self._width = buffers.block_table.shape[1]  # W
        self.host_offsets = np.zeros(max_requests, dtype=np.int32)
        # The host truth of a capture begin, [R, W]; any other begin's is its slot.
        self._own_block_table = np.full((max_requests, width), dummy,
                                        dtype=numpy_dtype(buffers.block_table.dtype))
        self.host_block_table = self._own_block_table
        self._full_counts = np.full(max_requests, width, dtype=np.int32)  # [R] of W
        self.host_block_counts = self._full_counts
        self.host_offsets_known = True
        self.begin_derived = False
        self.reused_table_rows = 0  # commit-pass rows placed from the reuse table so far
        # Host scratch the fused kernels write lengths into: [R + 1] int32 each.
        self._scratch_q = np.zeros(max_requests + 1, dtype=np.int32)
        self._scratch_kv = np.zeros(max_requests + 1, dtype=np.int32)

        self.begin = BeginStaging(buffers, runtime, max_requests=max_requests,
                                  block_size=block_size, dummy=dummy, num_slots=num_slots)
        self.lifecycle = DeviceLifecycle(self.device, runtime)  # born by MTPMetadata
        self.forward = ForwardStaging(buffers, runtime, max_requests=max_requests,
                                      max_tokens=max_tokens, num_slots=num_slots,
                                      reuse_table=self.begin.reuse_table,
                                      lifecycle=self.lifecycle)
        self.counted = CountedRoute(buffers, self.begin, self.forward,
                                    max_requests=max_requests, block_size=block_size,
                                    dummy=dummy)
        self.prefill_lengths = PrefillLengthsStaging(buffers, runtime,
                                                     max_requests=max_requests,
                                                     num_slots=num_slots)
        self.carry = CarryStaging(buffers, runtime)
        self.device_route = DeviceRoute(buffers, block_size=block_size, dummy=dummy,
                                        runtime=runtime, minus_one=self.forward.minus_one)
        # Prefixes of the persistent buffers by a name and a count <= R + 1: never
        # evicted. Every n's offsets prefix is built here: a draft loop builds none.
        self._slices = BoundedCache(64 * (max_requests + 2))
        for count in range(max_requests + 1):
            self._slices.prefix("offsets", buffers.offsets, count)
        self._order = StreamOrder(self.device, runtime)  # of the persistent buffers
        # An advance adds this one-entry tensor: a Python scalar would be wrapped into
        # a new host tensor at every call.
        self._one = torch.ones(1, dtype=buffers.offsets.dtype, device=self.device)

    @property
    def stream_order(self) -> StreamOrder:
        """The persistent buffers' stream order (the captured route enters it too)."""
        return self._order

    @property
    def fence_stalls(self) -> int:
        """Fence waits so far that found their slot still in use (each a host stall)."""
        rings = (self.begin.ring, self.prefill_lengths.ring, self.carry.ring)
        return self.forward.fence_stalls + sum(f.blocked for ring in rings
                                               for f in ring.fences)

    @property
    def named_counts(self) -> Optional[np.ndarray]:
        """The counts a draft depth's refusal names: the caller's (a counted begin),
        else None (whole rows, or derived counts: the caller passed none)."""
        return None if self.begin_derived or self.host_block_counts is \
            self._full_counts else self.host_block_counts

    def refuse_capture(self, method: str, *, shared: bool = True) -> None:
        """Raise ``GraphCaptureError`` (before anything is written) while a CUDA graph
        capture is underway on the device (``runtime.is_capturing``); then, for a call
        that touches the persistent buffers (``shared``), order it after the previous
        such call on another stream (``StreamOrder``)."""
        if self.runtime.is_capturing(self.device):
            raise GraphCaptureError(
                f"{method}: a CUDA graph capture is underway on {self.device}. "
                "MTP metadata setup stages through pinned host memory and keeps host-side "
                "draft state, so it runs eagerly before each replay (graphed=True), never "
                "inside the capture; capture only the forward that reads the view")
        if shared:
            self._order.enter()

    # ---------------------------------------------------------------- draft loop
    def begin_decode(self, count: int, start_positions: np.ndarray,
                     table_src: np.ndarray, block_counts: Optional[np.ndarray] = None
                     ) -> bool:
        """Stage the draft loop; False (nothing written) when a start position is
        negative or past the block table. With ``block_counts``, or on a wide table
        (``derives``), the counted route ships only the used columns."""
        self.refuse_capture("begin_decode")
        width = self._width
        if not native.draft_state.offsets_in_table(start_positions, count, self.block_size,
                                                   width):
            return False  # checked before a slot is taken: nothing written
        self.host_offsets_known = True
        self.begin_derived = False
        if block_counts is not None:
            self.host_block_table = self.counted.begin(count, start_positions, table_src,
                                                       block_counts, self.host_offsets)
            self.host_block_counts = self.counted.counts
            return True
        if derives(count * width, width):
            self.host_block_table = self.counted.begin_derived(
                count, start_positions, table_src, self.host_offsets)
            self.host_block_counts = self.counted.counts
            self.begin_derived = True
            return True
        begin = self.begin
        slot, self.host_block_table = begin.stage(count, start_positions, table_src,
                                                  self.host_offsets)
        self.host_block_counts = self._full_counts
        begin.ship(slot, count)
        return True

    def begin_decode_device(self, count: int, start_positions: Tensor, table_src: Tensor,
                            padded: Optional[int] = None) -> None:
        """``padded``: plan the loop's depths (``device_draft_plan``); None (the
        captured loop) copies the inputs and the device count only."""
        self.refuse_capture("begin_decode")
        self.device_route.begin_decode(count, start_positions, table_src, padded)
        self.host_offsets_known = False
        self.begin_derived = False
        self.host_block_counts = self._full_counts
        self.begin.drop_rows()  # the host never saw this table: nothing to reuse

    def begin_decode_for_capture(self, count: int) -> None:
        self.refuse_capture("begin_decode_for_capture")
        self.host_block_table = self._own_block_table  # never a slot a copy may read
        native.draft_state.fill_capture_state(self.host_offsets, self.host_block_table,
                                              count, self.dummy)
        self.host_block_counts = self._full_counts
        self.host_offsets_known = True
        self.begin_derived = False
        buffers = self.buffers
        self._slices.prefix("offsets", buffers.offsets, count).zero_()
        self._slices.prefix("block_table", buffers.block_table, count).fill_(self.dummy)
        buffers.draft_count.fill_(count)  # every row real for the device too
        self.begin.hold_dummy_rows(count)  # rows of D on both sides

    def advance_decode_step(self, count: int) -> None:
        self.refuse_capture("advance_decode_step")
        self._slices.prefix("offsets", self.buffers.offsets, count).add_(self._one)
        if self.host_offsets_known:  # after a device-route begin the host holds none
            native.draft_state.advance_offsets(self.host_offsets, count)
        self.device_route.advance_decode_step()

    def stage_decode_lengths(self, count: int) -> None:
        self.refuse_capture("stage_decode_lengths")
        buffers = self.buffers
        self._slices.prefix("query_lengths", buffers.query_lengths, count).fill_(1)
        torch.add(self._slices.prefix("offsets", buffers.offsets, count), 1,
                  out=self._slices.prefix("kv_lengths", buffers.kv_lengths, count))

    def decode_step(self, target: ViewTarget, count: int, padded: int,
                    graphed: bool) -> int:
        """One draft depth (eager or graphed alike); the largest KV length (0 when the
        host has no offsets), or -1 (nothing written) when a host-known offset is
        negative or past the table."""
        self.refuse_capture("setup_decode_step")
        if not self.host_offsets_known:
            self.device_route.decode_step(target, count, padded)
            return 0
        if not native.draft_state.offsets_in_table(self.host_offsets, count, self.block_size,
                                                   self._width):
            return -1  # checked before a slot is taken: nothing written, nothing staged
        # The shadow holds O(padded) data and no table: mha_block_table comes from the
        # persistent device table that begin_decode filled, device-to-device. Its
        # layout is fixed per view (DepthStage), so no shape builds a plan.
        forward = self.forward
        stage = forward.depth_stage(target)
        if stage is None:
            slot, layout, token_args, request_args = forward.shadow(target, padded, padded,
                                                                    0)
        else:  # writes the stage's bytes only (a counted commit's mark may survive)
            slot = forward.ring.acquire(stage.layout.nbytes)
            token_args, request_args = stage.args(slot)
        max_kv = native.staging.decode_step_maps(
            self.host_offsets, self.host_block_table, self.host_block_counts, count, padded,
            self.block_size, self.dummy, target.token_block_range[1], self._scratch_q,
            self._scratch_kv,
            *token_args, *request_args[:4])
        if max_kv < 0:  # a bad written block: the kernel wrote nothing, nothing ships
            forward.ring.release(slot)
            return packed_refusal(max_kv, self.host_offsets, self.host_block_table, count,
                                  self.block_size, self._width)
        if stage is None:
            forward.flush(target, slot, layout, padded, count, padded, "pair", count,
                          device_rows=count)
        else:
            stage.flush(slot, padded, count)
            forward.ring.release(slot)
        return max_kv

    # --------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int:
        self.refuse_capture("stage_prefill_lengths")
        return self.prefill_lengths.stage(counts, pad_tokens)

    def stage_prefill_lengths_device(self, counts: Tensor, pad_tokens: int) -> int:
        self.refuse_capture("stage_prefill_lengths")
        return self.device_route.stage_prefill_lengths(counts, pad_tokens)

    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int, padded_requests: int,
                    block_counts: Optional[np.ndarray] = None,
                    device_table: Optional[Tensor] = None
                    ) -> Tuple[int, int, int, int]:
        """The commit pass; ``(total, staged, padded_requests, max_len)`` as the kernel
        (a negative total: refused, nothing written). Its leading rows come from the
        caller's ``device_table`` (``BeginStaging.land_rows``) when given, else those
        that equal the draft loop's from the begin's reuse table
        (``BeginStaging.reusable_rows``); with ``block_counts`` or on a wide table, the
        counted route. The caller's rows are taken only where the landing's dtype holds
        every id the view's does (the host rows were checked against the view's)."""
        self.refuse_capture("setup_commit_pass")
        width, begin = self._width, self.begin
        low, high = target.table_block_range  # checked ids of the view: the landing's?
        if device_table is not None and target.width == width and \
                begin.table_range[0] <= low and high <= begin.table_range[1]:
            device_rows = begin.land_rows(device_table, counts.shape[0], pad_tokens)
        else:
            if block_counts is not None:  # no reused rows; only the used columns ship
                return self.counted.commit(target, counts, starts, table, inherited,
                                           block_counts, padded_tokens, pad_tokens,
                                           min_padded_requests, padded_requests)
            if derives(counts.shape[0] * width, width):
                result = self.counted.commit_derived(
                    target, counts, starts, table, inherited, padded_tokens, pad_tokens,
                    min_padded_requests, padded_requests)
                if result is not None:
                    return result
            device_rows = begin.reusable_rows(table, counts.shape[0], pad_tokens,
                                              self.host_block_table) \
                if target.width == width else 0
        forward = self.forward
        stage = forward.commit_stage(target)
        if stage is None or padded_tokens > stage.cap or padded_requests > stage.requests:
            stage = None
            slot, layout, token_args, request_args = forward.shadow(
                target, padded_tokens, padded_requests, padded_requests - device_rows)
        else:  # a fixed layout: nothing is built per shape (CommitStage)
            slot = forward.ring.acquire()
            token_args, request_args = stage.args(slot)
        total, staged, padded_requests, max_len = native.staging.commit_pass(
            counts, *kernel_optional(starts), table, *kernel_optional(inherited),
            padded_tokens, pad_tokens, self.max_requests, min_padded_requests,
            self.block_size, self.dummy, device_rows, width,
            target.token_block_range[1], self._scratch_q, *token_args, *request_args)
        if total < 0:  # a bad written block: the kernel wrote nothing, nothing ships
            forward.ring.release(slot)
            return total, staged, padded_requests, max_len
        if stage is None:
            forward.flush(target, slot, layout, padded_tokens, total, padded_requests,
                          "query", staged, device_rows, reused=True)
        else:
            stage.flush(slot, padded_tokens, total, padded_requests, staged, device_rows)
            forward.ring.release(slot)
        self.reused_table_rows += device_rows
        return total, staged, padded_requests, max_len

    # -------------------------------------------------------------------- writers
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray,
                         positions: np.ndarray, table: np.ndarray,
                         inherited: Optional[np.ndarray], padded: int) -> None:
        self.refuse_capture("write_token_maps", shared=False)
        slot, layout, token_args, _ = self.forward.shadow(target, padded, None)
        native.staging.write_token_maps(
            rows, positions, table, *kernel_optional(inherited), padded, self.block_size,
            self.dummy, *token_args)
        self.forward.flush(target, slot, layout, padded, positions.shape[0], None, "", 0)

    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None:
        self.refuse_capture("write_mha_metadata", shared=False)
        slot, layout, _, request_args = self.forward.shadow(target, 0, padded)
        native.staging.write_mha_metadata(query_lengths, kv_lengths, count, table,
                                          table.shape[0], padded, self.dummy, *request_args)
        self.forward.flush(target, slot, layout, 0, 0, padded, "", 0)

    def write_token_maps_device(self, target: ViewTarget, rows: Tensor, positions: Tensor,
                                table: Tensor, inherited: Optional[Tensor],
                                padded: int) -> None:
        self.refuse_capture("write_token_maps", shared=False)
        self.device_route.write_token_maps(target, rows, positions, table, inherited, padded)

    def write_mha_metadata_device(self, target: ViewTarget, query_lengths: Tensor,
                                  kv_lengths: Tensor, count: int, table: Tensor,
                                  padded: int) -> None:
        self.refuse_capture("write_mha_metadata", shared=False)
        self.device_route.write_mha_metadata(target, query_lengths, kv_lengths, count, table,
                                             padded)

    # ---------------------------------------------------------------- chunk carry
    def carry_hidden(self, source: Tensor) -> None:
        """Copy ``source`` (broadcastable to ``[1, 1, H]``) into the persistent carry
        (``CarryStaging.copy``)."""
        self.refuse_capture("carry_chunk_boundary")
        self.carry.copy(source)
