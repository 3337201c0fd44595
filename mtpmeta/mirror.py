"""Mirror path: numba staging into pinned host slots, async copies into persistent
device buffers, and small CUDA-graph-safe torch ops into the destination view.

Host truth, device snapshot: ``host_offsets`` / ``host_block_table`` are the host's own
copy of the draft state (so validation and ``ForwardShape`` need no read-back); the
device buffers are fixed-address snapshots. Two ways a draft depth reaches the view:

* eager with host-known offsets: the kernel writes a shadow of the view into a pinned
  slot, then one H2D copy plus ~7 device copies (``_flush``);
* graphed, or offsets that came from a device tensor: device ops only, computed from
  the persistent ``offsets`` / ``block_table`` (``_decode_step_on_device``), so a
  captured graph replays correctly against new ``begin_decode`` data.

Every device write here is ``copy_``/``fill_``/``out=`` into a fixed buffer: no new
storage in the draft loop, no ``.item()``. Device *inputs* to the writers (upstream call
sites pass some) take the device-op route too; their values are not checked (that
would be a sync) and out-of-table columns are sent to the dummy block instead.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import native
from .buffers import PersistentBuffers
from .gpu_view import ViewTarget
from .inputs import kernel_optional
from .staging import BoundedCache, CopyFence, ShadowLayout, StagingRing, numpy_dtype, paired

__all__ = ["MirrorBackend"]

_WIDEST = torch.int64  # staging capacity is sized for 8-byte fields
CopyPair = Tuple[Tensor, Tensor]  # (destination, source)


def _pair_copies(dst_a: Tensor, dst_b: Tensor, src_a: Tensor, src_b: Tensor,
                 length: int) -> List[CopyPair]:
    """Copies of ``src_*[:length]`` into ``dst_*[:length]``: one strided copy when both
    sides pair up, else two."""
    if length == 0:
        return []
    dst = paired(dst_a, dst_b, length)
    src = paired(src_a, src_b, length)
    if dst is not None and src is not None:
        return [(dst, src)]
    return [(dst_a[:length], src_a[:length]), (dst_b[:length], src_b[:length])]


class MirrorBackend:
    """Pinned staging + async copies + device ops. See the module docstring."""

    mirror = True

    def __init__(self, buffers: PersistentBuffers, *, max_requests: int, block_size: int,
                 dummy: int, max_tokens: int, num_slots: int = 4,
                 fence_factory: Callable[[torch.device], object] = CopyFence) -> None:
        self.buffers = buffers
        self.max_requests = max_requests
        self.block_size = block_size
        self.dummy = dummy
        self.device = buffers.offsets.device
        width = buffers.block_table.shape[1]
        table_dtype = buffers.block_table.dtype
        # Host truth of the draft state: [R] int32 and [R, W] of block_table_dtype.
        self.host_offsets = np.zeros(max_requests, dtype=np.int32)
        self.host_block_table = np.full((max_requests, width), dummy,
                                        dtype=numpy_dtype(table_dtype))
        self.host_offsets_known = True
        # Host scratch the fused kernels write lengths into: [R + 1] int32 each.
        self._scratch_q = np.zeros(max_requests + 1, dtype=np.int32)
        self._scratch_kv = np.zeros(max_requests + 1, dtype=np.int32)

        # begin_decode staging: offsets [R] int32 then block table [R, W].
        self._begin_layout = ShadowLayout.build((torch.int32, table_dtype),
                                                ((max_requests,), (max_requests, width)))
        self._begin_ring = StagingRing(self._begin_layout.nbytes, num_slots, self.device,
                                       fence_factory)
        self._begin_fields = [self._begin_layout.numpy_fields(self._begin_ring.host_np[i])
                              for i in range(num_slots)]
        self._begin_tensors = [self._begin_layout.tensor_fields(self._begin_ring.slots[i])
                               for i in range(num_slots)]
        # stage_prefill_lengths staging: [R + 1] int32.
        self._lengths_ring = StagingRing(4 * (max_requests + 1), num_slots, self.device,
                                         fence_factory)
        # Forward staging: a shadow of the view, sized for 8-byte fields at capacity.
        capacity = self._shadow_layout([_WIDEST] * 10, max_tokens, max_requests, width)
        self._fence_factory = fence_factory
        self._generation = 0  # bumped when the forward staging is re-sized
        self._forward_ring = StagingRing(capacity.nbytes, num_slots, self.device,
                                         fence_factory)
        # [capacity] uint8 device twin of one forward slot: the H2D copy lands here.
        self._device_stage = torch.zeros(capacity.nbytes, dtype=torch.uint8,
                                         device=self.device)
        # Device scratch of the graphed draft depth: [R] int64 columns, [R, 1] blocks.
        self._columns = torch.zeros(max_requests, dtype=torch.int64, device=self.device)
        self._gathered = torch.zeros((max_requests, 1), dtype=table_dtype,
                                     device=self.device)
        self._slices = BoundedCache(256)  # per-count views of the persistent buffers

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _shadow_layout(dtypes, tokens: int, requests: Optional[int],
                       width: int) -> ShadowLayout:
        """``requests=None``: a token-only forward with no MHA section at all."""
        count = requests or 0
        sums = 0 if requests is None else count + 1
        shapes = ((tokens,),) * 5 + ((count,), (count,), (sums,), (sums,), (count, width))
        return ShadowLayout.build(dtypes, shapes)

    def _grow(self, nbytes: int) -> None:
        """Re-size the forward staging for a forward larger than ``allocate`` planned.

        Only writers and commit passes can get here (a draft depth stages at most
        ``max_requests`` tokens), never the draft loop. Waits for every in-flight copy
        from the old slots first; plans built on the old buffers are retired by
        bumping ``_generation``, which every plan key carries.
        """
        for fence in self._forward_ring.fences:
            fence.wait()
        ring = self._forward_ring
        self._forward_ring = StagingRing(nbytes, ring.num_slots, self.device,
                                         self._fence_factory)
        self._device_stage = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._generation += 1

    def _prefix(self, name: str, tensor: Tensor, start: int, stop: int) -> Tensor:
        return self._slices.get((name, start, stop), lambda: tensor[start:stop])

    def _shadow(self, target: ViewTarget, tokens: int, requests: Optional[int]):
        """Acquire a forward slot; return ``(slot, layout, numpy fields)``."""
        key = ("layout", tokens, requests)
        layout = target.plans.get(key)
        if layout is None:
            layout = self._shadow_layout([t.dtype for t in target.tensors], tokens,
                                         requests, target.width)
            target.plans[key] = layout
        if layout.nbytes > self._forward_ring.slot_bytes:
            self._grow(layout.nbytes)
        slot = self._forward_ring.acquire()
        fields_key = ("fields", self._generation, slot, tokens, requests)
        fields = target.plans.get(fields_key)
        if fields is None:
            fields = layout.numpy_fields(self._forward_ring.host_np[slot])
            target.plans[fields_key] = fields
        return slot, layout, fields

    def _flush(self, target: ViewTarget, slot: int, layout: ShadowLayout, tokens: int,
               real_tokens: int, requests: int, to_lengths: str, lengths_count: int) -> None:
        """Copy the slot's shadow to the device and scatter it into the view.

        ``tokens``/``requests`` are the padded extents the shadow holds, ``real_tokens``
        the tokens whose request/position fields are written. ``to_lengths`` names what
        also lands in the persistent length buffers: ``"pair"`` (query and KV,
        ``lengths_count`` long), ``"query"`` (query only) or ``""``.

        The copy plan is cached on the view in parts keyed by the one size each depends
        on, so a workload whose token count varies step to step still reuses the views.
        """
        plans = target.plans
        if len(plans) > 4096:  # bound the cache on workloads of ever-new shapes
            plans.clear()
        generation = self._generation
        h2d = self._cached(plans, ("h2d", generation, slot, layout.nbytes), lambda: (
            self._device_stage[:layout.nbytes],
            self._forward_ring.slots[slot][:layout.nbytes]))
        h2d[0].copy_(h2d[1], non_blocking=True)
        self._forward_ring.release(slot)
        staged = self._cached(plans, ("staged", generation, layout),
                              lambda: layout.tensor_fields(self._device_stage))
        view = target.tensors
        buffers = self.buffers
        def padded_token_copies():  # block and local offset over the padded rows
            return _pair_copies(view[1], view[2], staged[1], staged[2], tokens)

        def real_token_copies():  # request, position and pos id of the real tokens only
            copies = _pair_copies(view[3], view[4], staged[3], staged[4], real_tokens)
            if real_tokens:
                copies.append((view[0][:real_tokens], staged[0][:real_tokens]))
            return copies

        def request_copies():  # MHA lengths, cumulative sums and block table
            if requests is None:
                return []
            return (_pair_copies(view[5], view[6], staged[5], staged[6], requests)
                    + _pair_copies(view[7], view[8], staged[7], staged[8], requests + 1)
                    + [(view[9][:requests], staged[9])])

        parts = [
            self._cached(plans, ("padded_tokens", generation, layout, tokens),
                         padded_token_copies),
            self._cached(plans, ("real_tokens", generation, layout, real_tokens),
                         real_token_copies),
            self._cached(plans, ("requests", generation, layout, requests), request_copies),
        ]
        if to_lengths == "pair":
            parts.append(self._cached(
                plans, ("pair", generation, layout, lengths_count),
                lambda: _pair_copies(buffers.query_lengths, buffers.kv_lengths, staged[5],
                                     staged[6], lengths_count)))
        elif to_lengths == "query" and lengths_count:
            parts.append(self._cached(
                plans, ("query", generation, layout, lengths_count),
                lambda: [(buffers.query_lengths[:lengths_count], staged[5][:lengths_count])]))
        for part in parts:
            for dst, src in part:
                dst.copy_(src, non_blocking=True)

    @staticmethod
    def _cached(plans: dict, key, build):
        value = plans.get(key)
        if value is None:
            value = build()
            plans[key] = value
        return value

    # ---------------------------------------------------------------- draft loop
    def begin_decode(self, count: int, start_positions: np.ndarray,
                     table_src: np.ndarray) -> bool:
        """Stage the draft loop; False (nothing written) when a start position is
        negative or past the block table."""
        if not native.staging.copy_decode_inputs(start_positions, table_src, count,
                                                 self.block_size, self.host_offsets,
                                                 self.host_block_table):
            return False
        self.host_offsets_known = True
        if count == 0:
            return True
        slot = self._begin_ring.acquire()
        offsets_np, table_np = self._begin_fields[slot]
        native.staging.copy_decode_inputs(start_positions, table_src, count,
                                          self.block_size, offsets_np, table_np)
        offsets_t, table_t = self._begin_tensors[slot]
        buffers = self.buffers
        self._prefix("offsets", buffers.offsets, 0, count).copy_(
            self._prefix(("begin_offsets", slot), offsets_t, 0, count), non_blocking=True)
        self._prefix("block_table", buffers.block_table, 0, count).copy_(
            self._prefix(("begin_table", slot), table_t, 0, count), non_blocking=True)
        self._begin_ring.release(slot)
        return True

    def begin_decode_device(self, count: int, start_positions: Tensor,
                            table_src: Tensor) -> None:
        buffers = self.buffers
        buffers.offsets[:count].copy_(start_positions[:count], non_blocking=True)
        buffers.block_table[:count].copy_(table_src[:count], non_blocking=True)
        self.host_offsets_known = False

    def begin_decode_for_capture(self, count: int) -> None:
        native.staging.fill_capture_state(self.host_offsets, self.host_block_table, count,
                                          self.dummy)
        self.host_offsets_known = True
        self._prefix("offsets", self.buffers.offsets, 0, count).zero_()
        self._prefix("block_table", self.buffers.block_table, 0, count).fill_(self.dummy)

    def advance_decode_step(self, count: int) -> None:
        self._prefix("offsets", self.buffers.offsets, 0, count).add_(1)
        native.staging.advance_offsets(self.host_offsets, count)

    def stage_decode_lengths(self, count: int) -> None:
        buffers = self.buffers
        self._prefix("query_lengths", buffers.query_lengths, 0, count).fill_(1)
        torch.add(self._prefix("offsets", buffers.offsets, 0, count), 1,
                  out=self._prefix("kv_lengths", buffers.kv_lengths, 0, count))

    def decode_step(self, target: ViewTarget, count: int, padded: int,
                    graphed: bool) -> int:
        """One draft depth; the largest KV length (0 when the host has no offsets), or
        -1 (nothing written) when a host-known offset is negative or past the table."""
        if self.host_offsets_known and not native.staging.offsets_in_table(
                self.host_offsets, count, self.block_size, self.host_block_table.shape[1]):
            return -1  # checked before a slot is taken: nothing written, nothing staged
        if not self.host_offsets_known:
            self._decode_step_on_device(target, count, padded)
            if not self.host_offsets_known:
                return 0
            return native.staging.stage_decode_lengths(self.host_offsets, count,
                                                       self._scratch_q, self._scratch_kv)
        slot, layout, fields = self._shadow(target, padded, padded)
        max_kv = native.staging.decode_step(self.host_offsets, self.host_block_table, count,
                                            padded, self.block_size, self.dummy,
                                            self._scratch_q, self._scratch_kv, *fields)
        self._flush(target, slot, layout, padded, count, padded, "pair", count)
        return max_kv

    def _decode_step_on_device(self, target: ViewTarget, count: int, padded: int) -> None:
        """One draft depth from the persistent device buffers alone (graph-capturable)."""
        key = ("device_step", count, padded)
        views = target.plans.get(key)
        if views is None:
            views = self._device_step_views(target, count, padded)
            target.plans[key] = views
        (offsets, table, columns, columns_2d, gathered, gathered_1d, rows, query, kv,
         pos_ids, block, local, request, position, pad_block, pad_local, mha_q, mha_kv,
         cu_q_head, cu_kv_head, cu_q_body, cu_kv_body, mha_table, pad_q, pad_kv, pad_cu_q,
         pad_cu_kv, cu_q_last, cu_kv_last, pad_table) = views
        torch.floor_divide(offsets, self.block_size, out=columns)
        torch.gather(table, 1, columns_2d, out=gathered)
        block.copy_(gathered_1d)
        torch.remainder(offsets, self.block_size, out=local)
        request.copy_(rows)
        position.copy_(offsets)
        pos_ids.copy_(offsets)
        pad_block.fill_(self.dummy)
        pad_local.fill_(0)
        query.fill_(1)
        torch.add(offsets, 1, out=kv)
        mha_q.copy_(query)
        mha_kv.copy_(kv)
        cu_q_head.zero_()
        cu_kv_head.zero_()
        torch.cumsum(query, 0, dtype=cu_q_body.dtype, out=cu_q_body)
        torch.cumsum(kv, 0, dtype=cu_kv_body.dtype, out=cu_kv_body)
        mha_table.copy_(table)
        if pad_q is not None:
            pad_q.zero_()
            pad_kv.zero_()
            pad_cu_q.copy_(cu_q_last.expand_as(pad_cu_q))
            pad_cu_kv.copy_(cu_kv_last.expand_as(pad_cu_kv))
            pad_table.fill_(-1)

    def _device_step_views(self, target: ViewTarget, n: int, p: int) -> tuple:
        buffers = self.buffers
        view = target.tensors
        has_pad = p > n
        return (
            buffers.offsets[:n], buffers.block_table[:n], self._columns[:n],
            self._columns[:n].unsqueeze(1), self._gathered[:n], self._gathered[:n, 0],
            buffers.row_ids[:n], buffers.query_lengths[:n], buffers.kv_lengths[:n],
            view[0][:n], view[1][:n], view[2][:n], view[3][:n], view[4][:n],
            view[1][n:p], view[2][n:p], view[5][:n], view[6][:n], view[7][:1],
            view[8][:1], view[7][1:n + 1], view[8][1:n + 1], view[9][:n],
            view[5][n:p] if has_pad else None, view[6][n:p] if has_pad else None,
            view[7][n + 1:p + 1] if has_pad else None,
            view[8][n + 1:p + 1] if has_pad else None, view[7][n:n + 1],
            view[8][n:n + 1], view[9][n:p] if has_pad else None)

    # --------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int:
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
        num_prefill = counts.shape[0]
        lengths = self.buffers.query_lengths
        if num_prefill:
            lengths[:num_prefill].copy_(counts, non_blocking=True)
        if pad_tokens > 0 and num_prefill < self.max_requests:
            lengths[num_prefill:num_prefill + 1].fill_(pad_tokens)
            return num_prefill + 1
        if pad_tokens > 0:
            lengths[num_prefill - 1:num_prefill].add_(pad_tokens)
        return num_prefill

    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int, padded_requests: int) -> Tuple[int, int, int]:
        slot, layout, fields = self._shadow(target, padded_tokens, padded_requests)
        total, staged, padded_requests, max_len = native.staging.commit_pass(
            counts, *kernel_optional(starts), table, *kernel_optional(inherited),
            padded_tokens, pad_tokens, self.max_requests, min_padded_requests,
            self.block_size, self.dummy, self._scratch_q, *fields)
        self._flush(target, slot, layout, padded_tokens, total, padded_requests, "query",
                    staged)
        return staged, padded_requests, max_len

    # -------------------------------------------------------------------- writers
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray,
                         positions: np.ndarray, table: np.ndarray,
                         inherited: Optional[np.ndarray], padded: int) -> None:
        slot, layout, fields = self._shadow(target, padded, None)
        native.staging.write_token_maps(
            rows, positions, table, *kernel_optional(inherited), padded, self.block_size,
            self.dummy, *fields[:5])
        self._flush(target, slot, layout, padded, positions.shape[0], None, "", 0)

    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None:
        slot, layout, fields = self._shadow(target, 0, padded)
        native.staging.write_mha_metadata(query_lengths, kv_lengths, count, table,
                                          table.shape[0], padded, self.dummy, *fields[5:])
        self._flush(target, slot, layout, 0, 0, padded, "", 0)

    def write_token_maps_device(self, target: ViewTarget, rows: Tensor, positions: Tensor,
                                table: Tensor, inherited: Optional[Tensor],
                                padded: int) -> None:
        """Device-op token maps (allocates temporaries; values unchecked: a column
        outside the table sends that token to the dummy block instead)."""
        pos_ids, block, local, request, position = target.tensors[:5]
        count = positions.shape[0]
        if count:
            rows_long = rows.long()
            columns = torch.div(positions, self.block_size, rounding_mode="floor").long()
            outside = (columns < 0) | (columns >= table.shape[1])
            blocks = table[rows_long, columns.clamp(0, table.shape[1] - 1)]
            redirect = outside
            if inherited is not None:
                redirect = redirect | (columns < inherited[rows_long])
            block[:count].copy_(blocks.masked_fill(redirect, self.dummy))
            if local.dtype == positions.dtype:
                torch.remainder(positions, self.block_size, out=local[:count])
            else:
                local[:count].copy_(torch.remainder(positions, self.block_size))
            request[:count].copy_(rows)
            position[:count].copy_(positions)
            pos_ids[:count].copy_(positions)
        if padded > count:
            block[count:padded].fill_(self.dummy)
            local[count:padded].fill_(0)

    def write_mha_metadata_device(self, target: ViewTarget, query_lengths: Tensor,
                                  kv_lengths: Tensor, count: int, table: Tensor,
                                  padded: int) -> None:
        """Device-op MHA metadata (no read-back; lengths are not checked)."""
        mha_q, mha_kv, cu_q, cu_kv, mha_table = target.tensors[5:]
        num_rows = table.shape[0]
        cu_q[:1].zero_()
        cu_kv[:1].zero_()
        if count:
            mha_q[:count].copy_(query_lengths)
            mha_kv[:count].copy_(kv_lengths)
            torch.cumsum(query_lengths, 0, dtype=cu_q.dtype, out=cu_q[1:count + 1])
            torch.cumsum(kv_lengths, 0, dtype=cu_kv.dtype, out=cu_kv[1:count + 1])
        if num_rows:
            mha_table[:num_rows].copy_(table)
        if count > num_rows:
            mha_table[num_rows:count].fill_(self.dummy)
        if padded > count:
            mha_q[count:padded].zero_()
            mha_kv[count:padded].zero_()
            cu_q[count + 1:padded + 1].copy_(cu_q[count:count + 1].expand(padded - count))
            cu_kv[count + 1:padded + 1].copy_(cu_kv[count:count + 1].expand(padded - count))
            mha_table[count:padded].fill_(-1)
