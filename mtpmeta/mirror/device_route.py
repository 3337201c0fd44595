"""The mirror path's device-op route, for inputs that are already device tensors.

Upstream call sites pass some inputs on the device (start positions, lengths, tables).
Reading them back would be a sync, so this route computes the same results with torch
ops on the device. Their values are not checked (that would be the sync): a block
column outside the table (a negative position or one past ``W * BS``) is clamped for
the gather and its token sent to the dummy block ``D``, exactly as the host route's
writers would never write a real block for it. Likewise a ``write_token_maps`` row
outside ``[0, rows of block_table)`` (or of ``inherited_blocks``) is clamped on the
device, with no sync and no device-side assert, and its token goes to ``D``: where the
host route raises IndexError, this route writes no real block. The draft depth here
allocates nothing: it writes through fixed views of the persistent buffers and of the
destination view; the writers stage through the view's own scratch (made at its
first device-route write: ``ViewTarget.writer_scratch``,
``token_scratch.TokenScratch``). With ``padded`` (the default route) ``begin_decode``
plans the loop's first ``PLANNED_DEPTHS`` depths (``device_draft_plan.DraftPlan``) and each
of them is one ``_foreach_copy_``; a later depth takes the per-depth ops of
``decode_step``.

Every caller tensor this route reads is ``record_stream``-ed on the current stream
through the runtime (``mtpmeta.buffers.device_runtime``), so its producer may free it right after the
call even when it allocated it on another stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.mirror.device_draft_plan import DraftPlan
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.buffers.grad_mode import kept_tensors
from mtpmeta.mirror.token_scratch import TokenScratch

# ``tensor[indices]`` into ``out`` (an out= gather with a C++ meta kernel, unlike
# ``take`` and ``index_select``'s out variants, so the meta bench times it faithfully).
_index_out = torch.ops.aten.index.Tensor_out

__all__ = ["write_lengths_and_table", "lengths_plan", "LengthsPlan", "scan_scratch",
           "draft_scratch", "DeviceRoute"]


def draft_scratch(buffers: PersistentBuffers,
                  masks: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Fixed-address scratch of a device-op draft depth over up to ``R`` rows:
    ``(columns [R] int64, masks [masks, R] bool, gathered [R, 1] of the table dtype)``,
    zero-filled on the buffers' device (allocated once, at construction)."""
    requests = buffers.block_table.shape[0]
    device = buffers.offsets.device
    return (torch.zeros(requests, dtype=torch.int64, device=device),
            torch.zeros((masks, requests), dtype=torch.bool, device=device),
            torch.zeros((requests, 1), dtype=buffers.block_table.dtype, device=device))


def scan_scratch(buffers: PersistentBuffers) -> Tensor:
    """``[2R + 1]`` int32 zeros on the buffers' device (allocated once, with a route):
    ``[:2R]`` viewed ``[2, R]`` takes the row scan of the persistent lengths, ``[2R]``
    is never written (the 0 the cumulative sums start with)."""
    requests = buffers.query_lengths.shape[0]
    return torch.zeros(2 * requests + 1, dtype=torch.int32, device=buffers.offsets.device)


@dataclass(frozen=True)
class LengthsPlan:
    """Fixed views of a draft depth's MHA fields over ``m`` rows (``write_lengths_and_table``).

    ``scan_in`` is the persistent ``[2, R]`` lengths (query row, KV row), ``scan_out``
    the ``[2, R]`` scratch of their running sums; ``dsts``/``srcs`` one
    ``_foreach_copy_``: both lengths, both cumulative sums (0, then the running sum)
    and, when its dtypes match, the block-table rows; ``table`` holds the table pair
    otherwise (its own ``copy_``).
    """

    scan_in: Tensor
    scan_out: Tensor
    dsts: List[Tensor]
    srcs: List[Tensor]
    table: Optional[Tuple[Tensor, Tensor]]


def lengths_plan(buffers: PersistentBuffers, scratch: Tensor, fields: Any, m: int,
                 table: Tensor) -> LengthsPlan:
    """The ``LengthsPlan`` of ``fields`` (the view's prefixes ``[:m]``, ``[:m + 1]`` for
    the cu fields) from the persistent lengths' first ``m`` rows and ``table`` ``[m, W]``
    (``scratch``: ``scan_scratch``'s)."""
    requests = buffers.query_lengths.shape[0]
    lengths = buffers.lengths
    sums = scratch[:2 * requests].view(2, requests)
    zero = scratch[2 * requests:]
    cu_q, cu_kv = fields.mha_cu_query_seq_lengths, fields.mha_cu_kv_seq_lengths
    dsts = [fields.mha_query_lengths, fields.mha_kv_seq_lengths, cu_q[:1], cu_kv[:1],
            cu_q[1:m + 1], cu_kv[1:m + 1]]
    srcs = [lengths[0, :m], lengths[1, :m], zero, zero, sums[0, :m], sums[1, :m]]
    pair: Optional[Tuple[Tensor, Tensor]] = (fields.mha_block_table, table)
    if fields.mha_block_table.dtype == table.dtype:
        dsts.append(fields.mha_block_table)
        srcs.append(table)
        pair = None
    return LengthsPlan(lengths, sums, dsts, srcs, pair)


def write_lengths_and_table(plan: LengthsPlan) -> None:
    """A draft depth's MHA fields from the staged device lengths: 2 device ops (3 when
    the table's dtype differs from the view's). One ``cumsum`` scans both whole
    ``[2, R]`` length rows, contiguous in and out: CUDA's row scan, which needs no
    workspace (a 1-D scan is a cub scan whose temporary storage comes from the caching
    allocator at every call). Then one ``_foreach_copy_`` places both lengths, both
    cumulative sums and the block-table rows. Shared by the device-input route and the
    captured route, which differ only in how they stage the lengths.
    """
    torch.cumsum(plan.scan_in, 1, dtype=torch.int32, out=plan.scan_out)
    torch._foreach_copy_(plan.dsts, plan.srcs)
    if plan.table is not None:
        plan.table[0].copy_(plan.table[1])


@dataclass(frozen=True)
class DecodeViews:
    """Fixed views one device-route draft depth writes through (``n`` real, ``p``
    padded requests); ``pad_*`` are None when ``p == n``."""

    offsets: Tensor  # [n] int32, persistent offsets
    table: Tensor  # [n, W] persistent block table
    columns: Tensor  # [n] int64 scratch: block column of each offset
    columns_2d: Tensor  # [n, 1] the same, for gather
    outside: Tensor  # [n] bool scratch: column outside [0, W)
    outside_high: Tensor  # [n] bool scratch
    gathered: Tensor  # [n, 1] scratch of the table dtype
    gathered_1d: Tensor  # [n] the same
    rows: Tensor  # [n] int64, 0..n-1
    query: Tensor  # [n] int32 persistent query lengths
    kv: Tensor  # [n] int32 persistent KV lengths
    fields: object  # ViewFields of the view prefixes [:n] ([:n + 1] for cu arrays)
    pad_tokens: Optional[object]  # (block [n:p], local [n:p])
    pad_requests: Optional[object]  # (q [n:p], kv [n:p], cu_q [n+1:p+1], cu_kv, table [n:p])
    lengths: LengthsPlan  # the MHA fields' scan and copies over n rows
    cu_last: object  # (cu_q [n:n+1], cu_kv [n:n+1])


class DeviceRoute:
    """Device ops over the persistent buffers and the destination view."""

    def __init__(self, buffers: PersistentBuffers, *, block_size: int, dummy: int,
                 runtime: Any = None, minus_one: Optional[Tensor] = None) -> None:
        self.runtime = runtime if runtime is not None else get_runtime()
        self.buffers = buffers
        self.block_size = block_size
        self.dummy = dummy
        self.width = buffers.block_table.shape[1]
        self.device = buffers.offsets.device
        # Draft-depth scratch: [R] int64 columns, [2, R] bool (outside, past the table),
        # [R, 1] gathered blocks.
        self._columns, self._outside, self._gathered = draft_scratch(buffers, 2)
        self._scan = scan_scratch(buffers)  # the lengths' row scan (write_lengths_and_table)
        # The loop's depths planned at begin_decode (device_draft_plan.py).
        self.plan = DraftPlan(buffers, block_size=block_size, dummy=dummy,
                              minus_one=minus_one)

    def _in_use(self, *tensors: Optional[Tensor]) -> None:
        """Tell the caching allocator the current stream reads these caller tensors."""
        for tensor in tensors:
            if tensor is not None:
                self.runtime.record_stream(tensor, self.device)

    # ---------------------------------------------------------------- draft loop
    def begin_decode(self, count: int, start_positions: Tensor, table_src: Tensor,
                     padded: Optional[int] = None) -> None:
        """Copy ``offsets[:n]``, ``block_table[:n]`` and ``draft_count``; with
        ``padded``, plan the loop's depths too (``DraftPlan.begin``: 7 device ops), else
        3 ops and nothing planned (the captured loop)."""
        plan = self.plan
        if padded is not None:
            plan.begin(count, padded, start_positions, table_src, self.runtime.is_host(table_src))
        else:
            plan.valid = False
            buffers = self.buffers
            buffers.offsets[:count].copy_(start_positions[:count], non_blocking=True)
            buffers.block_table[:count].copy_(table_src[:count], non_blocking=True)
            buffers.draft_count.fill_(count)  # the device count (contract §12)
        self._in_use(start_positions, table_src)

    def advance_decode_step(self) -> None:
        """The host's count of advances since the begin (the next planned depth)."""
        self.plan.depth += 1

    def decode_step(self, target: ViewTarget, count: int, padded: int) -> None:
        """One draft depth: the planned one (1 device op) while the loop's depth is
        within the plan, else from the persistent device buffers alone (16 ops, 23
        with pad rows)."""
        if self.plan.covers(count, padded):
            self.plan.place(target)
            return
        key = ("device_step", count, padded)
        v = target.plans.get(key)
        if v is None:
            v = self._decode_views(target, count, padded)
            target.plans.put(key, v)
        f = v.fields
        torch.floor_divide(v.offsets, self.block_size, out=v.columns)
        torch.lt(v.offsets, 0, out=v.outside)
        torch.ge(v.columns, self.width, out=v.outside_high)
        torch.logical_or(v.outside, v.outside_high, out=v.outside)
        v.columns.clamp_(0, self.width - 1)
        torch.gather(v.table, 1, v.columns_2d, out=v.gathered)
        f.token_to_block_idx.copy_(v.gathered_1d)
        f.token_to_block_idx.masked_fill_(v.outside, self.dummy)
        torch.remainder(v.offsets, self.block_size, out=f.token_to_local_position_within_kv_block)
        f.token_to_request_idx.copy_(v.rows)
        f.token_to_position_in_request.copy_(v.offsets)
        f.token_to_pos_ids.copy_(v.offsets)
        v.query.fill_(1)
        torch.add(v.offsets, 1, out=v.kv)
        write_lengths_and_table(v.lengths)
        if v.pad_tokens is not None:
            pad_block, pad_local = v.pad_tokens
            pad_block.fill_(self.dummy)
            pad_local.fill_(0)
            pad_q, pad_kv, pad_cu_q, pad_cu_kv, pad_table = v.pad_requests
            cu_q_last, cu_kv_last = v.cu_last
            pad_q.zero_()
            pad_kv.zero_()
            pad_cu_q.copy_(cu_q_last.expand_as(pad_cu_q))
            pad_cu_kv.copy_(cu_kv_last.expand_as(pad_cu_kv))
            pad_table.fill_(-1)

    def _decode_views(self, target: ViewTarget, n: int, p: int) -> DecodeViews:
        buffers = self.buffers
        view = target.fields
        prefix = type(view)(**{name: tensor[:n + 1] if name.startswith("mha_cu_")
                               else tensor[:n] for name, tensor in zip(view._fields, view)})
        pad = p > n
        return DecodeViews(
            offsets=buffers.offsets[:n], table=buffers.block_table[:n],
            columns=self._columns[:n], columns_2d=self._columns[:n].unsqueeze(1),
            outside=self._outside[0, :n], outside_high=self._outside[1, :n],
            gathered=self._gathered[:n], gathered_1d=self._gathered[:n, 0],
            rows=buffers.row_ids[:n],
            query=buffers.query_lengths[:n], kv=buffers.kv_lengths[:n], fields=prefix,
            pad_tokens=(view.token_to_block_idx[n:p],
                        view.token_to_local_position_within_kv_block[n:p]) if pad else None,
            pad_requests=(view.mha_query_lengths[n:p], view.mha_kv_seq_lengths[n:p],
                          view.mha_cu_query_seq_lengths[n + 1:p + 1],
                          view.mha_cu_kv_seq_lengths[n + 1:p + 1],
                          view.mha_block_table[n:p]) if pad else None,
            lengths=lengths_plan(buffers, self._scan, prefix, n, buffers.block_table[:n]),
            cu_last=(view.mha_cu_query_seq_lengths[n:n + 1],
                     view.mha_cu_kv_seq_lengths[n:n + 1]))

    # --------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, counts: Tensor, pad_tokens: int) -> int:
        num_prefill = counts.shape[0]
        lengths = self.buffers.query_lengths
        max_requests = lengths.shape[0]
        if num_prefill:
            lengths[:num_prefill].copy_(counts, non_blocking=True)
            self._in_use(counts)
        if pad_tokens > 0 and num_prefill < max_requests:
            lengths[num_prefill:num_prefill + 1].fill_(pad_tokens)
            return num_prefill + 1
        if pad_tokens > 0:
            lengths[num_prefill - 1:num_prefill].add_(pad_tokens)
        return num_prefill

    # -------------------------------------------------------------------- writers
    @staticmethod
    def _writer_plan(target: ViewTarget, count: int) -> Tuple[Tensor, ...]:
        """``write_mha_metadata``'s fixed views over ``count`` requests in the view's
        ``writer_scratch`` (the ``[2, m]`` staged query/KV rows and their sums for the
        row scan, then a 0; ``m``: the view's ``max_requests``) and the copy pairs."""
        m = target.max_requests
        if target.writer_scratch is None:
            with kept_tensors():
                target.writer_scratch = torch.zeros(4 * m + 1, dtype=torch.int32,
                                                    device=target.device)
        scratch = target.writer_scratch
        staged, sums, zero = (scratch[:2 * m].view(2, m), scratch[2 * m:4 * m].view(2, m),
                              scratch[4 * m:])
        query_in, kv_in = (row[:count] for row in staged.unbind(0))
        query_sums, kv_sums = (row[:count] for row in sums.unbind(0))
        f = target.fields
        cu_q, cu_kv = f.mha_cu_query_seq_lengths, f.mha_cu_kv_seq_lengths
        return (query_in, kv_in, staged, sums,
                [f.mha_query_lengths[:count], f.mha_kv_seq_lengths[:count], cu_q[:1],
                 cu_kv[:1], cu_q[1:count + 1], cu_kv[1:count + 1]],
                [query_in, kv_in, zero, zero, query_sums, kv_sums])

    def keep_inherited(self, target: ViewTarget, inherited: Optional[Tensor]
                       ) -> Optional[Tensor]:
        """A ``write_token_maps`` call's ``inherited`` as its record keeps it for
        ``check_invariants``: ``TokenScratch.keep`` (no allocation after the first)."""
        return None if inherited is None else TokenScratch.of(target).keep(
            inherited, self.buffers.block_table.shape[0])

    def write_token_maps(self, target: ViewTarget, rows: Tensor, positions: Tensor,
                         table: Tensor, inherited: Optional[Tensor], padded: int) -> None:
        """Device-op token maps (values unchecked, no sync): 12 device data ops with int64
        rows (one more for other rows, 3 more with ``inherited``, one more where the
        table's dtype is not the view's, 2 more for pad tokens), through the view's
        ``TokenScratch``: nothing allocated after the view's first call.

        A token whose block column lies outside the table, or whose row lies outside
        ``[0, usable)`` (``usable``: rows of ``table``, and of ``inherited`` when given;
        -1 and ``usable`` included), goes to the dummy block ``D``. Such a row is
        clamped into ``[0, usable)`` for the gathers and is the ``token_to_request_idx``
        written (an index every per-request array has); its local offset and positions
        are written as given. With ``usable == 0`` every token goes to ``D`` with
        request index 0.
        """
        f = target.fields
        block, local = f.token_to_block_idx, f.token_to_local_position_within_kv_block
        count = positions.shape[0]
        if count:
            self._in_use(rows, positions, table, inherited)
            scratch = TokenScratch.of(target)
            safe, columns, clamped, redirect, condition = scratch.views(count)
            usable = table.shape[0] if inherited is None else min(table.shape[0],
                                                                  inherited.shape[0])
            width, last_row = table.shape[1], max(usable - 1, 0)
            if rows.dtype == torch.int64:  # clamp writes only its input's dtype
                torch.clamp(rows, 0, last_row, out=safe)
            else:
                safe.copy_(rows)
                safe.clamp_(0, last_row)
            blocks = block[:count]
            if usable and width:
                torch.ne(safe, rows, out=redirect)  # a row outside [0, usable)
                torch.div(positions, self.block_size, rounding_mode="floor", out=columns)
                torch.clamp(columns, 0, width - 1, out=clamped)
                torch.ne(clamped, columns, out=condition)  # a column outside the table
                torch.bitwise_or(redirect, condition, out=redirect)
                if inherited is not None:  # a column the request inherited
                    firsts = scratch.typed("inherited", inherited.dtype, count)
                    _index_out(inherited, [safe], out=firsts)
                    torch.lt(columns, firsts, out=condition)
                    torch.bitwise_or(redirect, condition, out=redirect)
                if blocks.dtype == table.dtype:
                    _index_out(table, [safe, clamped], out=blocks)
                    blocks.masked_fill_(redirect, self.dummy)
                else:
                    gathered = scratch.typed("blocks", table.dtype, count)
                    _index_out(table, [safe, clamped], out=gathered)
                    gathered.masked_fill_(redirect, self.dummy)
                    blocks.copy_(gathered)
            else:
                blocks.fill_(self.dummy)
            torch.remainder(positions, self.block_size, out=local[:count])
            f.token_to_request_idx[:count].copy_(safe)
            f.token_to_position_in_request[:count].copy_(positions)
            f.token_to_pos_ids[:count].copy_(positions)
        if padded > count:
            block[count:padded].fill_(self.dummy)
            local[count:padded].fill_(0)

    def write_mha_metadata(self, target: ViewTarget, query_lengths: Tensor,
                           kv_lengths: Tensor, count: int, table: Tensor,
                           padded: int) -> None:
        """Device-op MHA metadata (no read-back; lengths are not checked). With int32
        length fields (both layouts'), both cumulative sums are one row scan of the
        view's own ``[2, max_requests]`` int32 scratch (no workspace on CUDA, as in the
        draft loops; per view, since view writers are not stream-ordered); other field
        dtypes take two 1-D scans (cub's temporary storage)."""
        self._in_use(query_lengths, kv_lengths, table)
        f = target.fields
        cu_q, cu_kv = f.mha_cu_query_seq_lengths, f.mha_cu_kv_seq_lengths
        mha_q, mha_kv, mha_table = f.mha_query_lengths, f.mha_kv_seq_lengths, f.mha_block_table
        num_rows = table.shape[0]
        if count and cu_q.dtype is cu_kv.dtype is mha_q.dtype is mha_kv.dtype is \
                torch.int32:
            plan = target.plans.get(("mha_writer", count))
            if plan is None:
                plan = self._writer_plan(target, count)
                target.plans.put(("mha_writer", count), plan)
            staged_q, staged_kv, staged, sums, dsts, srcs = plan
            staged_q.copy_(query_lengths)
            staged_kv.copy_(kv_lengths)
            torch.cumsum(staged, 1, dtype=torch.int32, out=sums)
            torch._foreach_copy_(dsts, srcs)
        else:
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
