"""The captured draft loop (contract §12): a draft depth's setup as device ops only, so it
can live inside the CUDA graph of the MTP forward.

``begin_decode(..., capture_setup=True)`` runs eagerly and stages ``offsets[:n]``,
``block_table[:n]`` and a device-resident request count ``count = [n]``. After it,
``setup_decode_step`` / ``advance_decode_step`` / ``stage_decode_lengths`` of the loop
are a fixed sequence of torch ops over ``p = padded_count`` rows of fixed-address
buffers (the persistent buffers, the scratch below, the destination view). They read
no host memory, no pinned slot and no host scalar that changes between steps, allocate
nothing and never sync, so a graph captured once at ``p`` (after
``begin_decode_for_capture(p, capture_setup=True)``) replays correctly for every real
count ``n' <= p`` that a later ``begin_decode`` stages. Rows ``[n', p)`` are masked with
the device count: token block ``D``, local 0, zero lengths, flat cumulative sums,
``-1`` block rows. A real row whose block column falls outside ``[0, W)``, or whose
table entry there is negative (an unallocated block), also goes to ``D`` (the device
cannot raise; the default route refuses both instead).

The same torch ops run on both backends: on the direct path the device is the CPU and
a replayed graph could never re-run a numba kernel, so this route uses none.

Fields the default route leaves untouched on pad rows (request index, both positions)
are written here with the row ids and position 0: a forward must not read them there
(the default route gives them no meaning either), but a gather by position (RoPE)
stays in range, although every replay advances the pad rows' offsets too.

Streams: run eagerly, every depth, advance and length staging first enters the
persistent buffers' ``StreamOrder`` (mirror path), as the default route does; inside a
capture it records nothing, so a replay is ordered by the stream it is launched on: the
stream the loop's ``begin_decode`` ran on (contract §12).

Cost note: 23 device ops per depth (``DEPTH_OPS``), 1 per advance, all inside the graph
at replay; the host's only work per step is ``begin_decode``, the default route's own:
2 data ops on the mirror path (one H2D copy of the count, the offsets and the table
rows into the begin's landing, then one copy into ``draft_head[:n + 1]``, the count
just before ``offsets``, and ``block_table[:n]``: ``BeginStaging.ship``), no torch op
on the direct path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.mirror.device_route import (LengthsPlan, draft_scratch, lengths_plan, scan_scratch,
                            write_lengths_and_table)
from mtpmeta.buffers.device_runtime import StreamOrder

__all__ = ["CapturedRoute", "mark_pad_rows", "DEPTH_OPS", "ADVANCE_OPS"]

DEPTH_OPS = 23  # device ops one captured setup_decode_step issues (tests count them)
ADVANCE_OPS = 1  # device ops one captured advance_decode_step issues


def mark_pad_rows(row_ids: Tensor, count: Tensor, out: Tensor) -> Tensor:
    """``out[i] = row_ids[i] >= count[0]``: the pad mask, from the device count.

    row_ids: [p] int64; count: [1] int32 (device); out: [p] bool. One device op.
    """
    return torch.ge(row_ids, count, out=out)


@dataclass(frozen=True)
class _LengthViews:
    """Fixed views of the masked length staging at padded count ``p``."""

    row_ids: Tensor  # [p] int64, 0..p-1
    offsets: Tensor  # [p] int32, persistent offsets
    pad: Tensor  # [p] bool scratch: row >= n
    query: Tensor  # [p] int32, persistent query lengths
    kv: Tensor  # [p] int32, persistent KV lengths


@dataclass(frozen=True)
class _DepthViews:
    """Fixed views one captured depth at padded count ``p`` writes through."""

    row_ids: Tensor  # [p] int64, 0..p-1
    offsets: Tensor  # [p] int32, persistent offsets
    table: Tensor  # [p, W] persistent block table
    pad: Tensor  # [p] bool scratch: row >= n
    pad_2d: Tensor  # [p, 1] the same, broadcast over block columns
    outside: Tensor  # [p] bool scratch: pad row, negative offset or block, column >= W
    high: Tensor  # [p] bool scratch: column >= W, then: negative block
    columns: Tensor  # [p] int64 scratch: block column of each offset
    columns_2d: Tensor  # [p, 1] the same, for gather
    gathered: Tensor  # [p, 1] scratch of the table dtype
    gathered_1d: Tensor  # [p] the same
    query: Tensor  # [p] int32, persistent query lengths
    kv: Tensor  # [p] int32, persistent KV lengths
    fields: Any  # ViewFields of the view prefixes [:p] ([:p + 1] for cu arrays)
    lengths: LengthsPlan  # the MHA fields' scan and copies over p rows


class CapturedRoute:
    """Device-count draft loop over fixed buffers; see the module docstring.

    Holds, from ``allocate`` on (never allocated later):
    ``count`` (``PersistentBuffers.draft_count``, [1] int32 device: the loop's real
    request count ``n``, stored just before ``offsets``), ``[3, R]`` bool mask scratch,
    ``[R]`` int64 column scratch and ``[R, 1]`` gathered-block scratch. Staging is the
    backends' own ``begin_decode`` (it writes the count through ``stage_count``).
    """

    def __init__(self, buffers: PersistentBuffers, *, block_size: int, dummy: int,
                 order: Optional[StreamOrder] = None) -> None:
        self.buffers = buffers
        # The persistent buffers' stream order (mirror path; None on the direct path):
        # run eagerly, every call here orders itself after the last call on another
        # stream, as the default route does; inside a capture it records nothing.
        self._order = order
        self.block_size = block_size
        self.dummy = dummy
        self.width = buffers.block_table.shape[1]
        self.count = buffers.draft_count  # [1] int32: n, just before offsets
        # [R] int64 columns; [3, R] bool: pad rows, outside rows, columns past the
        # table; [R, 1] gathered blocks.
        self._columns, self._masks, self._gathered = draft_scratch(buffers, 3)
        self._scan = scan_scratch(buffers)  # the lengths' row scan (write_lengths_and_table)
        self._lengths_plans = BoundedCache(256)  # p -> _LengthViews

    # ------------------------------------------------------------- draft loop
    def decode_step(self, target: ViewTarget, padded: int) -> None:
        """One draft depth over ``padded`` rows: ``DEPTH_OPS`` device ops, no host read."""
        v = target.plans.get(("captured_step", padded))
        if v is None:
            v = self._depth_views(target, padded)
            target.plans.put(("captured_step", padded), v)
        if self._order is not None:
            self._order.enter_unless_capturing()
        f = v.fields
        mark_pad_rows(v.row_ids, self.count, v.pad)
        torch.floor_divide(v.offsets, self.block_size, out=v.columns)
        torch.lt(v.offsets, 0, out=v.outside)
        torch.ge(v.columns, self.width, out=v.high)
        torch.logical_or(v.outside, v.high, out=v.outside)
        torch.logical_or(v.outside, v.pad, out=v.outside)
        v.columns.clamp_(0, self.width - 1)
        torch.gather(v.table, 1, v.columns_2d, out=v.gathered)
        torch.lt(v.gathered_1d, 0, out=v.high)  # an unallocated (-1) block: to D as well
        torch.logical_or(v.outside, v.high, out=v.outside)
        f.token_to_block_idx.copy_(v.gathered_1d)
        f.token_to_block_idx.masked_fill_(v.outside, self.dummy)
        torch.remainder(v.offsets, self.block_size,
                        out=f.token_to_local_position_within_kv_block)
        f.token_to_local_position_within_kv_block.masked_fill_(v.pad, 0)
        f.token_to_request_idx.copy_(v.row_ids)
        torch.logical_not(v.pad, out=v.query)  # query lengths: 1 real, 0 pad
        # Positions: the offset on real rows, 0 on pad rows (multiplied by the query
        # length), so pad rows stay in range however many replays advanced them.
        torch.mul(v.offsets, v.query, out=f.token_to_position_in_request)
        torch.mul(v.offsets, v.query, out=f.token_to_pos_ids)
        self._kv_lengths(v)
        write_lengths_and_table(v.lengths)
        f.mha_block_table.masked_fill_(v.pad_2d, -1)

    @staticmethod
    def _kv_lengths(v: Any) -> None:
        """KV ``offset + 1`` on real rows, 0 on pad rows (2 ops; ``v.pad`` holds the
        pad mask)."""
        torch.add(v.offsets, 1, out=v.kv)
        v.kv.masked_fill_(v.pad, 0)

    def stage_decode_lengths(self, padded: int) -> None:
        """``stage_decode_lengths`` over ``padded`` rows, masked (4 device ops)."""
        v = self._lengths_views(padded)
        if self._order is not None:
            self._order.enter_unless_capturing()
        mark_pad_rows(v.row_ids, self.count, v.pad)
        torch.logical_not(v.pad, out=v.query)
        self._kv_lengths(v)

    def advance_decode_step(self, padded: int) -> None:
        """``offsets[:padded] += 1`` in place: one device op (pad rows move too; they
        are masked at every depth, their positions written as 0)."""
        if self._order is not None:
            self._order.enter_unless_capturing()
        self.buffers.offsets[:padded].add_(1)

    # ------------------------------------------------------------------- views
    def _lengths_views(self, p: int) -> "_LengthViews":
        v = self._lengths_plans.get(p)
        if v is None:
            buffers = self.buffers
            v = _LengthViews(buffers.row_ids[:p], buffers.offsets[:p], self._masks[0, :p],
                             buffers.query_lengths[:p], buffers.kv_lengths[:p])
            self._lengths_plans.put(p, v)
        return v

    def _depth_views(self, target: ViewTarget, p: int) -> _DepthViews:
        buffers = self.buffers
        view = target.fields
        prefix = type(view)(**{name: tensor[:p + 1] if name.startswith("mha_cu_")
                               else tensor[:p] for name, tensor in zip(view._fields, view)})
        return _DepthViews(
            row_ids=buffers.row_ids[:p],
            offsets=buffers.offsets[:p], table=buffers.block_table[:p],
            pad=self._masks[0, :p], pad_2d=self._masks[0, :p].unsqueeze(1),
            outside=self._masks[1, :p], high=self._masks[2, :p],
            columns=self._columns[:p], columns_2d=self._columns[:p].unsqueeze(1),
            gathered=self._gathered[:p], gathered_1d=self._gathered[:p, 0],
            query=buffers.query_lengths[:p], kv=buffers.kv_lengths[:p], fields=prefix,
            lengths=lengths_plan(buffers, self._scan, prefix, p, buffers.block_table[:p]))
