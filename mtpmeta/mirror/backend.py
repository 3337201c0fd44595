"""Mirror path: numba staging into pinned host slots, async copies into persistent
device buffers, and a few small torch ops into the destination view.

Host truth, device snapshot: ``host_offsets`` / ``host_block_table`` are the host's own
copy of the draft state (so validation and ``ForwardShape`` need no read-back); the
device buffers are fixed-address snapshots. Every draft depth, eager or ``graphed``,
and every commit pass and host-input writer goes one way: the kernel writes a tight
*shadow* of the view into a pinned slot, one H2D copy moves it into that slot's own
device stage, and a few device copies scatter it into the view (``_flush``). The slot's
fence is recorded after the scatter, so neither the pinned slot nor its device stage is
rewritten while any op that reads it may still be pending, on any stream. Draft depths
and commit passes on the fixed stages land in the ring's one shared device zone instead
(``shadow_stage.py``), ordered across streams by the stream order below.

``graphed=True`` means the MTP forward that follows replays a captured graph reading
the view's fixed addresses; the setup itself runs here, eagerly, before each replay.
Every call that stages refuses to run while a capture is underway on the device, as far
as the runtime sees (``GraphCaptureError``): captured, it would bake a pinned slot and
the captured request count into the graph and leave the host's draft state behind the
device's; and a fence's event query during another stream's global-mode capture would
invalidate that capture.

Streams: the persistent buffers (offsets, block table, query/KV lengths, the carry) are
one state. Every call that writes or reads them first orders itself after the previous
such call when the current stream changed (``StreamOrder``: an event recorded on the
previous stream, waited on by the current one), so a pass on stream B never rewrites a
length that a forward issued on stream A has yet to read, nor the shared zone a depth or
pass on stream A has yet to place from. View writers touch only the
caller's view, their own slot's stage and the view's own device scratch
(``ViewTarget.writer_scratch``), and are not ordered.

Caller device tensors that queued work reads (the carry's device hidden, device-route
inputs) get ``record_stream`` on the current stream through the runtime, so a producer
that allocated them on another stream may free them at once.

Inputs that are already device tensors take ``DeviceRoute`` (``mirror_device.py``;
its draft loop is planned at ``begin_decode``, ``device_loop.py``).

Table reuse: a commit pass takes its leading table rows device-to-device, as a draft
depth takes its table: the longest prefix of ``[:min(P, n)]`` equal to the rows that
draft loop staged (compared on the host against ``host_block_table``; the rest are
copied, so each row is compared or copied, one pass per table), but from
``_reuse_table``, a private device copy that no public name aliases: begin_decode's one
H2D copy lands the head and the rows in a private landing whose table part it is, and
one ``_foreach_copy_`` fills ``draft_head[:n + 1]`` and ``block_table[:n]`` from it (2
data ops per begin; 14 per standard step, advances included; the rows ship rounded up
to ``BEGIN_ROWS``, so its views are per slot and bucket), so no write into the persistent
buffers (in place, ``.data``, DLPack, a graph replay, under ``torch.inference_mode``)
can reach a row a commit places. A step whose commit pass follows its draft loop on one
table ships that table once, not twice (``_rows_on_device``; ``reused_table_rows``
counts the rows so placed). On a wide table (``mirror_counts.derives``) a begin writes
its slot's rows by their used columns and a commit pass ships packed rows, reusing none
(``mirror_counts``, "Derived counts").

The forward staging (the ring, the shadows and fixed stages, their cost and growth)
is ``ForwardStaging`` in ``mirror_staging.py``, a mixin of ``MirrorBackend``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.buffers import persistent
from mtpmeta.kernels import native
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.errors import GraphCaptureError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels.entry import kernel_optional
from mtpmeta.buffers.layout import PackedLayout, numpy_dtype
from mtpmeta.mirror.counted import CountedStaging, derives
from mtpmeta.mirror.device_route import DeviceRoute
from mtpmeta.mirror.forward_staging import _ALIGN, ForwardStaging
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.buffers.device_runtime import DeviceRuntime, StreamOrder, get_runtime
from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.mirror.pinned_ring import StagingRing

__all__ = ["MirrorBackend", "BEGIN_ROWS"]

#: A host-route begin ships its table rows rounded up to this many (module docstring).
BEGIN_ROWS = 8


class MirrorBackend(ForwardStaging, CountedStaging):
    """Pinned staging + async copies + device ops. See the module docstring."""

    mirror = True

    def __init__(self, buffers: PersistentBuffers, *, max_requests: int, block_size: int,
                 dummy: int, max_tokens: int, num_slots: int = 8,
                 runtime: Optional[DeviceRuntime] = None) -> None:
        self.runtime = runtime if runtime is not None else get_runtime()
        self.buffers = buffers
        self.max_requests = max_requests
        self.block_size = block_size
        self.dummy = dummy
        self.device = buffers.offsets.device
        width = buffers.block_table.shape[1]
        self._width = width  # W: host_block_table may be a counted begin's [n, C] rows
        table_dtype = buffers.block_table.dtype
        # Host truth of the draft state: [R] int32 and [R, W] of block_table_dtype. The
        # table is the pinned begin slot begin_decode staged it in (rows [:n] valid): a
        # slot is only rewritten by a later begin_decode, which re-points this first, so
        # the table is copied on the host once per draft loop, not twice.
        self.host_offsets = np.zeros(max_requests, dtype=np.int32)
        self._own_block_table = np.full((max_requests, width), dummy,
                                        dtype=numpy_dtype(table_dtype))
        self.host_block_table = self._own_block_table
        self.host_offsets_known = True
        self.reused_table_rows = 0  # commit-pass rows placed from _reuse_table so far
        # Host scratch the fused kernels write lengths into: [R + 1] int32 each.
        self._scratch_q = np.zeros(max_requests + 1, dtype=np.int32)
        self._scratch_kv = np.zeros(max_requests + 1, dtype=np.int32)
        runtime = self.runtime

        # begin_decode staging: the draft head [R + 1] int32 (the device count n, then
        # the offsets, laid out as buffers.draft_head) and the block table [R, W].
        begin = PackedLayout.build((("head", torch.int32, (max_requests + 1,)),
                                    ("block_table", table_dtype, (max_requests, width))),
                                   align=_ALIGN)
        self._begin_ring = StagingRing(begin.nbytes, num_slots, self.device, runtime)
        self._begin_arrays = [begin.arrays(self._begin_ring.host_np[i])
                              for i in range(num_slots)]
        self._begin_tensors = [begin.tensors(self._begin_ring.slots[i])
                               for i in range(num_slots)]
        # The begin's device landing, laid out as a begin slot and aliased by no public
        # name: a head, then ``_reuse_table`` [R, W] of the table dtype, whose rows
        # [:_device_table_rows] equal host_block_table's (begin_decode's host route and
        # begin_decode_for_capture write them, in stream order); a commit pass places
        # such rows device-to-device (_rows_on_device), never from block_table.
        self._begin_landing = torch.empty(begin.nbytes, dtype=torch.uint8,
                                          device=self.device)
        self._landing_head, self._reuse_table = begin.tensors(self._begin_landing)
        self._reuse_table.fill_(dummy)
        self._table_words = word_view(buffers.block_table)
        self._reuse_words = word_view(self._reuse_table)
        self._device_table_rows = 0
        self._begin_table_at = begin.offsets[1]  # bytes before a slot's table rows
        self._begin_row_bytes = width * self._reuse_table.element_size()
        # stage_prefill_lengths staging: [R + 1] int32.
        self._lengths_ring = StagingRing(4 * (max_requests + 1), num_slots, self.device,
                                         runtime)
        # carry_chunk_boundary staging of a host hidden: [H] of the hidden dtype.
        hidden = buffers.chunk_boundary_hidden
        self._carry_ring = StagingRing(hidden.numel() * hidden.element_size(), 2,
                                       self.device, runtime)
        self._carry_slots = [slot[:hidden.numel() * hidden.element_size()]
                             .view(hidden.dtype).view(hidden.shape)
                             for slot in self._carry_ring.slots]
        self._init_forward_staging(max_requests, max_tokens, width, num_slots)
        self._init_counts(max_requests, width)  # the opt-in block counts (mirror_counts)
        self.device_route = DeviceRoute(buffers, block_size=block_size, dummy=dummy,
                                        runtime=runtime, minus_one=self._minus_one)
        # Per-count views of the persistent buffers and begin slots: keys are a name (a
        # slot's at most) and a count <= R + 1, so this bound is never reached.
        self._slices = BoundedCache(64 * (max_requests + 2))
        # Every n's begin pair and advance prefix now: a draft loop of a new n builds
        # neither.
        for count in range(max_requests + 1):
            self._slices.put(("begin_place", count), self._begin_pairs(count))
            self._prefix("offsets", buffers.offsets, 0, count)
        self._order = StreamOrder(self.device, runtime)  # of the persistent buffers
        self.lifecycle = DeviceLifecycle(self.device, runtime)  # born by MTPMetadata

    @property
    def stream_order(self) -> StreamOrder:
        """The persistent buffers' stream order (the captured route enters it too)."""
        return self._order

    @property
    def fence_stalls(self) -> int:
        """Fence waits so far that found their slot still in use (each a host stall)."""
        rings = (self._begin_ring, self._lengths_ring, self._carry_ring, self._forward_ring)
        return self._retired_stalls + sum(f.blocked for ring in rings for f in ring.fences)

    # ------------------------------------------------------------------ helpers
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

    def _prefix(self, name, tensor: Tensor, start: int, stop: int) -> Tensor:
        key = (name, start, stop)
        value = self._slices.get(key)  # get_or_build, inlined: several calls per step
        if value is None:
            value = tensor[start:stop]
            self._slices.put(key, value)
        return value

    # ---------------------------------------------------------------- draft loop
    def begin_decode(self, count: int, start_positions: np.ndarray,
                     table_src: np.ndarray, block_counts: Optional[np.ndarray] = None
                     ) -> bool:
        """Stage the draft loop; False (nothing written) when a start position is
        negative or past the block table. With ``block_counts``: ``mirror_counts``."""
        self.refuse_capture("begin_decode")
        if not native.draft_state.offsets_in_table(start_positions, count, self.block_size,
                                                   self._width):
            return False  # checked before a slot is taken: nothing written
        self.host_offsets_known = True
        self.begin_derived = False
        if block_counts is not None:
            self._begin_counted(count, start_positions, table_src, block_counts)
            return True
        if derives(count * self._width, self._width):
            self._begin_derived(count, start_positions, table_src)
            return True
        slot = self._begin_ring.acquire()
        head_np, table_np = self._begin_arrays[slot]
        native.draft_state.copy_decode_inputs(start_positions, table_src, count,
                                          self.block_size, head_np[1:], table_np)
        self._packed_rows[slot] = 0  # the slot's packed rows (mirror_counts): rewritten
        return self._staged_begin(slot, count, head_np, table_np)

    def _staged_begin(self, slot: int, count: int, head_np: np.ndarray,
                      table_np: np.ndarray) -> bool:
        """Finish a default begin whose head and whole table rows ``[:n]`` are staged
        in ``slot``: they become the host truth and ship (``_ship_begin``)."""
        self.host_block_counts = self._full_counts
        # The device count too, in the same copy: a graph captured with capture_setup
        # (contract §12) replayed after this begin masks rows [n, padded) as pad rows.
        persistent.stage_count(head_np, count)
        self.host_offsets[:count] = head_np[1:count + 1]
        self.host_block_table = table_np  # the host truth is the staged slot itself
        self._ship_begin(slot, count)
        self._begin_ring.release(slot)
        self._device_table_rows = count
        return True

    def _ship_begin(self, slot: int, count: int) -> None:
        """Two data ops: one H2D copy of the begin ``slot``'s head and its leading table
        rows, ``count`` rounded up to ``BEGIN_ROWS`` (rows past ``count`` land in
        ``_reuse_table`` past ``_device_table_rows``, never read), into the landing;
        then one device copy of ``draft_head[:n + 1]`` and ``block_table[:n]`` from it
        (both as int32 words; two copies when their words differ). So the views built
        are per slot and bucket of rows, and per ``count``, never per (slot, count)."""
        rows = min(-(-count // BEGIN_ROWS) * BEGIN_ROWS, self.max_requests)
        land, source = self._slices.get_or_build(("begin_h2d", slot, rows),
                                                 lambda: self._begin_h2d(slot, rows))
        land.copy_(source, non_blocking=True)
        dsts, srcs, grouped = self._slices.get_or_build(("begin_place", count),
                                                        lambda: self._begin_pairs(count))
        if grouped:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        else:  # no rows, or words that differ (a table dtype of other than 4 or 8 bytes)
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)

    def _begin_h2d(self, slot: int, rows: int) -> Tuple[Tensor, Tensor]:
        end = self._begin_table_at + rows * self._begin_row_bytes
        return self._begin_landing[:end], self._begin_ring.slots[slot][:end]

    def _begin_pairs(self, count: int) -> Tuple[List[Tensor], List[Tensor], bool]:
        """``([draft_head[:n + 1], block_table[:n]], [their landing rows], grouped)``,
        the table's pair as int32 words (``word_view``; none for ``count`` 0);
        ``grouped``: two pairs of one dtype, one ``_foreach_copy_``."""
        dsts = [self.buffers.draft_head[:count + 1]]
        srcs = [self._landing_head[:count + 1]]
        if count:
            dsts.append(self._table_words[:count])
            srcs.append(self._reuse_words[:count])
        grouped = len(dsts) > 1 and len({t.dtype for t in dsts + srcs}) == 1
        return dsts, srcs, grouped

    def begin_decode_device(self, count: int, start_positions: Tensor, table_src: Tensor,
                            padded: Optional[int] = None) -> None:
        """``padded``: plan the loop's depths (``device_loop.py``); None (the captured
        loop) copies the inputs and the device count only."""
        self.refuse_capture("begin_decode")
        self.device_route.begin_decode(count, start_positions, table_src, padded)
        self.host_offsets_known = False
        self.begin_derived = False
        self.host_block_counts = self._full_counts
        self._device_table_rows = 0  # the host never saw this table: nothing to reuse

    def begin_decode_for_capture(self, count: int) -> None:
        self.refuse_capture("begin_decode_for_capture")
        self.host_block_table = self._own_block_table  # never a slot a copy may read
        native.draft_state.fill_capture_state(self.host_offsets, self.host_block_table, count,
                                          self.dummy)
        self.host_block_counts = self._full_counts
        self.host_offsets_known = True
        self.begin_derived = False
        self._prefix("offsets", self.buffers.offsets, 0, count).zero_()
        self._prefix("block_table", self.buffers.block_table, 0, count).fill_(self.dummy)
        self.buffers.draft_count.fill_(count)  # every row real for the device too
        self._prefix("reuse_table", self._reuse_table, 0, count).fill_(self.dummy)
        self._device_table_rows = count  # rows of D on both sides

    def advance_decode_step(self, count: int) -> None:
        self.refuse_capture("advance_decode_step")
        self._prefix("offsets", self.buffers.offsets, 0, count).add_(1)
        native.draft_state.advance_offsets(self.host_offsets, count)
        self.device_route.advance_decode_step()

    def stage_decode_lengths(self, count: int) -> None:
        self.refuse_capture("stage_decode_lengths")
        buffers = self.buffers
        self._prefix("query_lengths", buffers.query_lengths, 0, count).fill_(1)
        torch.add(self._prefix("offsets", buffers.offsets, 0, count), 1,
                  out=self._prefix("kv_lengths", buffers.kv_lengths, 0, count))

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
        stage = self._depth_stage(target)
        if stage is None:
            slot, layout, token_args, request_args = self._shadow(target, padded, padded,
                                                                  0)
        else:  # writes the stage's bytes only (a counted commit's mark may survive)
            slot = self._forward_ring.acquire(stage.layout.nbytes)
            token_args, request_args = stage.args(slot)
        max_kv = native.staging.decode_step_maps(
            self.host_offsets, self.host_block_table, self.host_block_counts, count, padded,
            self.block_size, self.dummy, target.token_block_range[1], self._scratch_q,
            self._scratch_kv,
            *token_args, *request_args[:4])
        if max_kv < 0:  # a bad written block: the kernel wrote nothing, nothing ships
            self._forward_ring.release(slot)
            return self._packed_refusal(count, max_kv)
        if stage is None:
            self._flush(target, slot, layout, padded, count, padded, "pair", count,
                        device_rows=count)
        else:
            stage.flush(slot, padded, count)
            self._forward_ring.release(slot)
        return max_kv

    # --------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int:
        self.refuse_capture("stage_prefill_lengths")
        ring = self._lengths_ring
        slot = ring.acquire()
        staged_np = ring.host_np[slot].view(np.int32)
        staged = native.staging.stage_prefill_lengths(counts, pad_tokens, self.max_requests,
                                                      staged_np)
        if staged:
            source = self._prefix(("prefill_src", slot), ring.slots[slot].view(torch.int32),
                                  0, staged)
            self._prefix("query_lengths", self.buffers.query_lengths, 0, staged).copy_(
                source, non_blocking=True)
        ring.release(slot)
        return staged

    def stage_prefill_lengths_device(self, counts: Tensor, pad_tokens: int) -> int:
        self.refuse_capture("stage_prefill_lengths")
        return self.device_route.stage_prefill_lengths(counts, pad_tokens)

    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int, padded_requests: int,
                    block_counts: Optional[np.ndarray] = None
                    ) -> Tuple[int, int, int, int]:
        self.refuse_capture("setup_commit_pass")
        if block_counts is not None:  # no reused rows; only the used columns ship
            return self._commit_counted(target, counts, starts, table, inherited,
                                        block_counts, padded_tokens, pad_tokens,
                                        min_padded_requests, padded_requests)
        if derives(counts.shape[0] * self._width, self._width):
            result = self._commit_derived(target, counts, starts, table, inherited,
                                          padded_tokens, pad_tokens, min_padded_requests,
                                          padded_requests)
            if result is not None:
                return result
        device_rows = self._rows_on_device(target, table, counts.shape[0], pad_tokens)
        stage = self._commit_stage(target)
        if stage is None or padded_tokens > stage.cap or padded_requests > stage.requests:
            stage = None
            slot, layout, token_args, request_args = self._shadow(
                target, padded_tokens, padded_requests, padded_requests - device_rows)
        else:  # a fixed layout: nothing is built per shape (CommitStage)
            slot = self._forward_ring.acquire()
            token_args, request_args = stage.args(slot)
        total, staged, padded_requests, max_len = native.staging.commit_pass(
            counts, *kernel_optional(starts), table, *kernel_optional(inherited),
            padded_tokens, pad_tokens, self.max_requests, min_padded_requests,
            self.block_size, self.dummy, device_rows, self.buffers.block_table.shape[1],
            target.token_block_range[1], self._scratch_q, *token_args, *request_args)
        if total < 0:  # a bad written block: the kernel wrote nothing, nothing ships
            self._forward_ring.release(slot)
            return total, staged, padded_requests, max_len
        if stage is None:
            self._flush(target, slot, layout, padded_tokens, total, padded_requests,
                        "query", staged, device_rows, reused=True)
        else:
            stage.flush(slot, padded_tokens, total, padded_requests, staged, device_rows)
            self._forward_ring.release(slot)
        self.reused_table_rows += device_rows
        return total, staged, padded_requests, max_len

    def _rows_on_device(self, target: ViewTarget, table: np.ndarray, num_prefill: int,
                        pad_tokens: int) -> int:
        """How many leading rows of a commit pass's ``table`` [>= P, W] to place from
        the private device table instead of the shadow: the longest prefix of the
        first ``min(P, n)`` rows (n the rows the last host-route ``begin_decode``
        staged) that equals the host copy of what the device holds (``matching_rows``:
        compared, never assumed). The kernel copies the rows after it, so each row is
        compared or copied: one pass over the table. The row that absorbs a full
        batch's pad is cut back by the kernel and never taken. The rows are placed
        from the private ``_reuse_table``, which holds ``host_block_table[:n]``
        whatever was written into the public buffers since (no version counter needed).
        """
        rows = min(num_prefill, self._device_table_rows)
        if pad_tokens > 0 and num_prefill == self.max_requests:
            rows = min(rows, num_prefill - 1)
        if rows <= 0 or target.width != self._width:
            return 0
        return native.draft_state.matching_rows(table, self.host_block_table, rows)

    # -------------------------------------------------------------------- writers
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray,
                         positions: np.ndarray, table: np.ndarray,
                         inherited: Optional[np.ndarray], padded: int) -> None:
        self.refuse_capture("write_token_maps", shared=False)
        slot, layout, token_args, _ = self._shadow(target, padded, None)
        native.staging.write_token_maps(
            rows, positions, table, *kernel_optional(inherited), padded, self.block_size,
            self.dummy, *token_args)
        self._flush(target, slot, layout, padded, positions.shape[0], None, "", 0)

    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None:
        self.refuse_capture("write_mha_metadata", shared=False)
        slot, layout, _, request_args = self._shadow(target, 0, padded)
        native.staging.write_mha_metadata(query_lengths, kv_lengths, count, table,
                                          table.shape[0], padded, self.dummy, *request_args)
        self._flush(target, slot, layout, 0, 0, padded, "", 0)

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
        """Copy ``source`` (broadcastable to ``[1, 1, H]``) into the persistent carry.

        A device tensor is copied on the stream (ordered before any later use) and
        ``record_stream``-ed there, so the caching allocator keeps it alive for that copy
        even if its producer allocated it on another stream and frees it at once. A
        host tensor is first copied
        into a fenced pinned slot, so the async copy never reads pageable memory the
        caller may free or overwrite right after this call returns.
        """
        self.refuse_capture("carry_chunk_boundary")
        target = self.buffers.chunk_boundary_hidden
        if not self.runtime.is_host(source):
            target.copy_(source, non_blocking=True)
            self.runtime.record_stream(source, self.device)
            return
        ring = self._carry_ring
        slot = ring.acquire()
        staged = self._carry_slots[slot]
        if source.is_contiguous() and source.dtype == staged.dtype and \
                source.numel() == staged.numel():
            # A numpy byte copy into the pinned slot: no torch op, so the carry costs
            # one data op (the H2D copy). Views only: view(-1), view(uint8), detach.
            ring.host_np[slot][:staged.numel() * staged.element_size()] = \
                source.view(-1).view(torch.uint8).numpy()
        else:
            staged.copy_(source)  # broadcast or strided: torch does the gather
        target.copy_(staged, non_blocking=True)
        ring.release(slot)
