"""The device-input draft loop, planned at ``begin_decode``: a few batched device ops
over ``[PLANNED_DEPTHS, n]``, then one placement per depth.

After ``begin_decode`` with device tensors the host knows no offsets, so the mirror
path computes a depth on the device (``DeviceRoute``). Rather than ~28 ops at every
depth, ``begin`` computes every depth ``d < PLANNED_DEPTHS`` of the loop at once, as
upstream's depth would compute it from ``offsets + d``, into fixed-address scratch
(allocated once, with the backend): positions, block ids (the D/out-of-table masking
of ``DeviceRoute``), local offsets, KV lengths and both cumulative sums. Depth ``d``
(the host counts the advances since the begin; no sync) then places its row of that
plan into the view and the persistent length buffers with one ``torch._foreach_copy_``.

Ops (counted by ``DeviceOpCounter``/``OpCounter`` as dispatches): ``begin`` 7 (the
copy into ``block_table``, the copy into the plan's padded table, one addcmul that
writes every planned position and the query row's ones as int64, one remainder that
narrows them to the int32 position rows (``offsets[:n]`` among them) and gives their
local offsets, a bucketize giving every planned block column, a gather, and one
row-wise cumsum giving every depth's KV sums and the cumulative query lengths, pad
entries flat, and ``draft_count``), one more when ``n`` is below the last planned
loop's (that loop's planned rows past ``n`` are zeroed first); each planned depth 1; a
depth past the plan takes ``DeviceRoute``'s per-depth ops. Both table copies stay:
the host table crosses into the contiguous ``block_table`` rows (a strided
destination would stage it through a temporary), and a gather from contiguous rows
can reach no ``D`` entry for a column outside its row. Exact for every start
position: the addcmul sums the int32 bits of the start positions (an int64 tensor's
low words, a view) and ``d`` in int32, as ``offsets + d`` wraps, then widens; the
remainder by ``2**32`` keeps those bits, the one by ``BS`` is int32 ``pos % BS``.

On CUDA the ``_foreach_copy_`` is one multi-tensor launch only when every pair has one
dtype (4- and 8-byte fields are read as int32 words, as ``placement.CopyPlan`` does)
and every tensor is dense with its pair's strides (all are prefixes and whole rows;
the simulator's ``unfused_foreach_copies`` checks it, ``tests/test_op_budget.py``):
the plan's block ids are kept in the dtype of the last view's ``token_to_block_idx``
(a change costs one fill of the padded table's ``D`` columns at the next begin); a
pair whose dtypes differ (the first loop on another view dtype, a
``block_table_dtype`` unlike the view's) goes as its own ``copy_``. The copy of
``[n, W]`` table rows is part of each depth's placement. The cumsum scans whole
``[PLANNED_DEPTHS, R + 1]`` rows, contiguous in and out: CUDA's row scan, which stages
nothing through a temporary and needs no workspace (a 1-D ``cumsum`` on CUDA is a cub
scan whose temporary storage comes from the caching allocator at every call); the
bucketize reads and writes whole contiguous ``[K, R]`` rows of its bounds' dtype (a
strided or converted operand is staged through a copy); the other ops are
elementwise (converting to the output's dtype in the kernel), a gather and copies,
which take strided views as they are.

Snapshot: the plan is taken from ``start_positions`` and ``block_table_src`` at the
begin. As on the host route, an in-place edit of ``active_offsets`` or
``active_block_table`` after it does not reach the token maps (the ``mha_block_table``
rows still come from ``block_table`` at every depth); call ``begin_decode`` again.

Layout tricks (``PersistentBuffers.draft_plan``): ``offsets`` is row ``[0, 0]`` of the
``[2, PLANNED_DEPTHS + 2, R + 1]`` int32 rows (row ``[0, d]``: ``offsets + d``, row
``[1, d]``: its local offsets ``(offsets + d) % BS`` for ``d <= PLANNED_DEPTHS``, row
``[0, K + 1]``: ``n`` ones, each after one leading entry: ``draft_count`` in row
``[0, 0]``, 0 in the others), so the remainder that narrows the planned positions also
writes the offsets, and rows ``[0, 1:]`` (a 0, then depth ``d``'s KV lengths
``offsets + d + 1``, then the ones) are the scan input as they stand, zero past ``n``.
The scan's output ``[PLANNED_DEPTHS + 1, R + 1]`` ends where the position rows begin,
so its last entry, the query row's total ``n``, is ``draft_count``; its query row is
``min(i, n)``, the cumulative query lengths. Block ids come from a padded table
``[R, W + 2]`` (``D`` in columns 0 and ``W + 1``) gathered at the bucket of each
position among ``0, BS, ..., W * BS`` (``clamp((pos + BS) // BS, 0, W + 1)``): an
out-of-table column lands on a ``D`` column without a mask.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from mtpmeta.buffers.persistent import PLANNED_DEPTHS, PersistentBuffers, head_offset
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.prefixes import Prefixes

__all__ = ["DraftPlan", "PLANNED_DEPTHS"]

K = PLANNED_DEPTHS
_LOW_WORD = 0 if sys.byteorder == "little" else 1  # an int64's low int32 word


def _int32_bits(start_positions: Tensor, count: int) -> Tensor:
    """``start_positions[:count]`` as the int32 values the ``offsets`` buffer takes from
    them: an int64 tensor's low words (a view; a copy into int32 keeps those bits), any
    other dtype as it is."""
    if start_positions.dtype is not torch.int64:
        return start_positions[:count]
    if start_positions.dim() == 1 and start_positions.stride(0) == 1:
        return start_positions.view(torch.int32)[_LOW_WORD:2 * count:2]
    return start_positions[:count].unsqueeze(1).view(torch.int32)[:, _LOW_WORD]


def _cuts(tensor: Tensor, words: bool, counter: List[int]) -> Prefixes:
    """Cached prefixes and row ranges of ``tensor`` (as int32 words with ``words``),
    indexed in its own elements (``scale`` 1)."""
    return Prefixes(word_view(tensor) if words else tensor, False, counter)


class _ViewSide:
    """One view's fields as prefix caches, raw and as int32 words (per target)."""

    def __init__(self, target: ViewTarget, dummies: Dict[torch.dtype, Tensor],
                 counter: List[int]) -> None:
        f = target.fields
        self.fields = f
        self.raw = {name: _cuts(t, False, counter) for name, t in zip(f._fields, f)}
        self.words = {name: _cuts(t, True, counter) for name, t in zip(f._fields, f)}
        self.scale = {name: (2 if t.dtype.itemsize == 8 and word_view(t) is not t else 1)
                      for name, t in zip(f._fields, f)}
        self.width = f.mha_block_table.shape[1] if f.mha_block_table.dim() == 2 else 0
        block = f.token_to_block_idx.dtype
        self.plan_dtype = block if block in dummies else torch.int64  # the plan's dtype
        # (planned dtype, depth, n, p) -> the placement's pair lists (fixed views).
        self.placements = BoundedCache(4096)


class DraftPlan:
    """The planned device-input draft loop over ``buffers`` (see the module docstring).

    Scratch (device, fixed addresses, allocated here): the padded table ``[R, W + 2]``
    (int64 storage, read as int32 when the view's block ids are int32), block ids
    ``[K, R]`` (same), int64 positions ``[K + 2, R]`` and block columns ``[K, R]``, and
    constants (steps, scales, moduli, bucket bounds, ``arange``, ones-then-zeros, ``D``);
    the int32 position rows, local offsets and sums are in
    ``buffers.draft_plan``.
    """

    def __init__(self, buffers: PersistentBuffers, *, block_size: int, dummy: int,
                 minus_one: Optional[Tensor] = None) -> None:
        self.buffers = buffers
        self.block_size = block_size
        self.dummy = dummy
        requests, width = buffers.block_table.shape
        self.requests, self.width = requests, width
        device = buffers.offsets.device
        i32, i64 = torch.int32, torch.int64
        row = requests + 1
        flat, start = buffers.draft_plan, head_offset(requests)
        # [K + 1, R + 1]: depth d's KV sums (rows 0..K-1), then the query sums (row K),
        # whose last entry is draft_count (the first of draft_head).
        self._sums = flat[:start + 1].view(K + 1, row)
        self._rows = flat[start:].view(2, K + 2, row)  # [0, 0] is draft_head
        self._positions = self._rows[0, :K + 1, 1:]  # [K + 1, R]: offsets + d
        self._local = self._rows[1, :K, 1:]  # [K, R]: (offsets + d) % BS
        self._planned_rows = self._rows[:, :, 1:]  # [2, K + 2, R]
        # [K + 1, R + 1], the sums' scan input: depth d's KV lengths offsets + d + 1
        # (rows 0..K-1), then n ones (row K), each after a 0 (column 0, never written).
        self._scan_rows = self._rows[0, 1:]
        # Every planned row but the offsets' is zero past n (a depth places its pad rows'
        # KV lengths and local offsets from them); ``_dirty``: columns left nonzero.
        self._zeroable = self._rows.view(2 * (K + 2), row)[1:]
        self._dirty = 0
        # Factory ops only (the CUDA simulator of the tests tracks those as device).
        # Row d of the wide positions is steps[d] + start * scales[d]: d for d <= K,
        # then 1 (the query row, scale 0).
        self._steps = torch.arange(K + 2, dtype=i32, device=device).view(K + 2, 1)
        self._steps[K + 1].fill_(1)
        self._scales = torch.ones((K + 2, 1), dtype=i32, device=device)
        self._scales[K + 1].zero_()
        # [K + 2, R] int64: the planned positions (token_to_pos_ids' rows) and the ones.
        self._wide = torch.zeros((K + 2, requests), dtype=i64, device=device)
        self._moduli = torch.full((2, 1, 1), 1 << 32, dtype=i64, device=device)
        self._moduli[1].fill_(block_size)  # 2**32: the int32 bits; BS: local offsets
        # The bucketize's bounds 0, BS, ..., W * BS, input [K, R] and block columns.
        self._bounds = torch.arange(width + 1, dtype=i64, device=device) * block_size
        self._planned_wide = self._wide[:K]
        self._columns = torch.zeros((K, requests), dtype=i64, device=device)
        self._arange = torch.arange(row + 1, dtype=i32, device=device)
        self._ones_zeros = torch.zeros(2 * requests, dtype=i32, device=device)
        self._ones_zeros[:requests].fill_(1)
        # D in each block dtype it fits (int32 only when it does; a view whose block ids
        # cannot hold D is refused before any depth).
        self._dummies = {dtype: torch.full((requests,), dummy, dtype=dtype, device=device)
                         for dtype in (i32, i64)
                         if torch.iinfo(dtype).min <= dummy <= torch.iinfo(dtype).max}
        self._minus_one = minus_one if minus_one is not None else torch.full(
            (requests * width,), -1, dtype=i32, device=device)
        # Padded table and block ids: int64 storage, typed per block dtype.
        table64 = torch.full((requests, width + 2), dummy, dtype=i64, device=device)
        blocks64 = torch.zeros((K, requests), dtype=i64, device=device)
        self._tables = {i64: table64,
                        i32: table64.view(-1).view(i32)[:requests * (width + 2)]
                        .view(requests, width + 2)}
        self._blocks = {i64: blocks64,
                        i32: blocks64.view(-1).view(i32)[:K * requests].view(K, requests)}
        self._dtype = i64  # block dtype of the next plan: the last view's
        self._planned_dtype = i64  # block dtype of the current plan
        self._dummy_columns = i64  # the dtype whose D columns the padded table holds
        # Host state of the loop: rows planned, padded count, advances since the begin.
        self.count = 0
        self.padded = 0
        self.valid = False
        self.depth = 0
        # Per-depth source rows (prefix caches; ``_builds[0]`` counts their views).
        self._builds = [0]
        self._src: List[Dict[str, Prefixes]] = []

        def cut(tensor: Tensor, words: bool = False) -> Prefixes:
            return _cuts(tensor, words, self._builds)

        for d in range(K):
            self._src.append({
                "local": cut(self._local[d], True),
                "pos32": cut(self._positions[d], True),
                "pos64": cut(self._wide[d], True),
                "kv": cut(self._positions[d + 1], True),
                "sums_kv": cut(self._sums[d], True)})
        self._consts = {"ones_zeros": cut(self._ones_zeros),
                        "arange": cut(self._arange), "sums_q": cut(self._sums[K]),
                        "minus_one": cut(self._minus_one),
                        "table": cut(buffers.block_table),
                        "query": cut(buffers.query_lengths),
                        "kv_buf": cut(buffers.kv_lengths)}
        self._dummy_cuts = {dtype: cut(t, True) for dtype, t in self._dummies.items()}
        self._block_cuts = {dtype: [cut(blocks[d], True) for d in range(K)]
                            for dtype, blocks in self._blocks.items()}
        self._queries: Dict[int, Prefixes] = {}  # R - n -> ones-then-zeros window
        self._minus_rows: Dict[int, Tensor] = {}  # pad rows -> [rows, W] of -1
        # The begin's views by (block dtype, n) and its zeroings by n (at most 2R + 2
        # and R).
        self._row_cache: Dict[Any, Tuple[Tensor, ...]] = {}
        self._stale_cache: Dict[int, Tensor] = {}

    # ------------------------------------------------------------------- begin
    def begin(self, count: int, padded: int, start_positions: Tensor,
              table_src: Tensor, host_table: bool = False) -> None:
        """Copy the inputs (``offsets[:n]``, ``block_table[:n]``, ``draft_count``) and
        plan depths ``0..K-1`` of the loop: 7 device ops (see the module docstring).

        ``host_table``: ``table_src`` is in host memory (the engine's pinned table).
        Its rows then cross to the device once, into ``block_table[:n]`` (both
        contiguous), and the padded table copies them from there on the device; a
        second host copy into the padded table's strided rows would move them twice
        and, on CUDA, stage them through a temporary."""
        n, p, w = count, padded, self.width
        dtype = self._dtype
        table = self._tables[dtype]
        if self._dummy_columns is not dtype:  # a new block dtype: its D columns
            table[:, ::w + 1].fill_(self.dummy)
            self._dummy_columns = dtype
        if self._dirty > n:  # an older loop's planned rows past n: zero them
            self._stale_rows(n).zero_()
        self._dirty = n
        if n:
            (table_rows, padded_rows, wide, wide_pair, planned, index, blocks,
             gathered) = self._rows_views(dtype, n)
            rows_src = table_src if table_src.shape[0] == n else table_src[:n]
            table_rows.copy_(rows_src, non_blocking=True)
            padded_rows.copy_(table_rows if host_table else rows_src, non_blocking=True)
            # offsets + d (d <= K; summed in int32, as the offsets wrap) and the query
            # row's ones, widened to int64 (token_to_pos_ids' rows).
            torch.addcmul(self._steps, _int32_bits(start_positions, n), self._scales,
                          out=wide)
            # Narrowed to int32 (mod 2**32: offsets[:n] in row [0, 0], the positions,
            # the KV lengths and the ones) and their local offsets (mod BS), in one op.
            torch.remainder(wide_pair, self._moduli, out=planned)
            # Block column + 1 of each, clamped to [0, W + 1]: whole rows (contiguous
            # in and out; the columns past n are never read).
            torch.bucketize(self._planned_wide, self._bounds, right=True, out=self._columns)
            torch.gather(gathered, 1, index, out=blocks)
        # Every depth's KV sums, then the query sums min(i, n) ending in draft_count = n:
        # each row [0, n values, 0...] scanned whole. [K + 1, R + 1] in and out, both
        # contiguous: CUDA's row scan, which needs no workspace (a 1-D scan goes through
        # cub, whose temporary storage comes from the caching allocator at every call).
        torch.cumsum(self._scan_rows, 1, dtype=torch.int32, out=self._sums)
        self.count, self.padded, self.depth, self.valid = n, p, 0, True
        self._planned_dtype = dtype

    def _rows_views(self, dtype: torch.dtype, n: int) -> Tuple[Tensor, ...]:
        """The begin's views over ``n`` rows (built once per block dtype and ``n``)."""
        views = self._row_cache.get((dtype, n))
        if views is None:
            table = self._tables[dtype]
            wide = self._wide[:, :n]
            views = self._row_cache[(dtype, n)] = (
                self.buffers.block_table[:n], table[:n, 1:self.width + 1], wide,
                wide.expand(2, K + 2, n), self._planned_rows[:, :, :n],
                self._columns[:, :n].t(), self._blocks[dtype][:, :n].t(), table[:n])
        return views

    def _stale_rows(self, start: int) -> Tensor:
        """Columns ``start:`` of the zeroable rows (built once per ``start``)."""
        view = self._stale_cache.get(start)
        if view is None:
            view = self._stale_cache[start] = self._zeroable[:, 1 + start:]
        return view

    def covers(self, count: int, padded: int) -> bool:
        """Whether the next depth is planned (same loop, depth < K)."""
        return self.valid and self.depth < K and count == self.count and \
            padded == self.padded

    # ------------------------------------------------------------------- depth
    def place(self, target: ViewTarget) -> None:
        """Place planned depth ``self.depth`` into ``target`` and the persistent
        query/KV lengths: one ``_foreach_copy_``, plus a ``copy_`` per pair whose
        dtypes differ (none when the view's dtypes are the plan's)."""
        side = target.plans.get("device_plan")
        if side is None:
            side = _ViewSide(target, self._dummies, self._builds)
            target.plans.put("device_plan", side)
        # The next plan's block dtype: the view's, where D fits it.
        self._dtype = side.plan_dtype
        key = (self._planned_dtype, self.depth, self.count, self.padded)
        placement = side.placements.get(key)
        if placement is None:
            placement = self._placement(side)
            side.placements.put(key, placement)
        dsts, srcs, singles = placement
        if len(dsts) > 1:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        elif dsts:
            dsts[0].copy_(srcs[0], non_blocking=True)
        for dst, source in singles:
            dst.copy_(source, non_blocking=True)

    def _placement(self, side: "_ViewSide") -> Tuple[List[Tensor], List[Tensor],
                                                     List[Tuple[Tensor, Tensor]]]:
        """The pairs that place the current depth into ``side``'s view: ``(dsts, srcs)``
        of one ``_foreach_copy_`` (int32 words) and the dtype-converting ``singles``."""
        f = side.fields
        block = f.token_to_block_idx.dtype
        n, p, d = self.count, self.padded, self.depth
        src, c = self._src[d], self._consts
        dsts: List[Tensor] = []
        srcs: List[Tensor] = []
        singles: List[Tuple[Tensor, Tensor]] = []
        words, raw, scale = side.words, side.raw, side.scale

        def put(name: str, a: int, b: int, cut: Prefixes, source: Tensor) -> None:
            """view.<name>[a:b] <- source[:b - a] (``cut``: its word prefixes)."""
            if b <= a:
                return
            if getattr(f, name).dtype == source.dtype and \
                    scale[name] == source.dtype.itemsize // 4:
                s = scale[name]
                dsts.append(words[name].prefix(b * s) if a == 0 else
                            words[name].rows(a * s, b * s))
                srcs.append(cut.prefix((b - a) * s))
            else:
                singles.append((raw[name].prefix(b) if a == 0 else raw[name].rows(a, b),
                                source[:b - a]))

        planned = self._planned_dtype
        put("token_to_block_idx", 0, n, self._block_cuts[planned][d],
            self._blocks[planned][d])
        dummy = block if block in self._dummies else torch.int64
        put("token_to_block_idx", n, p, self._dummy_cuts[dummy], self._dummies[dummy])
        # The planned rows are zero past n: the local offsets' row gives the pad rows.
        put("token_to_local_position_within_kv_block", 0, p, src["local"], self._local[d])
        put("token_to_request_idx", 0, n, c["arange"], self._arange)
        put("token_to_position_in_request", 0, n, src["pos32"], self._positions[d])
        put("token_to_pos_ids", 0, n, src["pos64"], self._wide[d])
        window = self._window(self.requests - n)
        put("mha_query_lengths", 0, p, window, window.tensor)
        # So does the KV lengths' row.
        put("mha_kv_seq_lengths", 0, p, src["kv"], self._positions[d + 1])
        put("mha_cu_query_seq_lengths", 0, p + 1, c["sums_q"], self._sums[K])
        put("mha_cu_kv_seq_lengths", 0, p + 1, src["sums_kv"], self._sums[d])
        self._table_rows(side, n, p, dsts, srcs, singles)
        if n:  # the persistent lengths, as stage_decode_lengths writes them
            dsts += [c["query"].prefix(n), c["kv_buf"].prefix(n)]
            srcs += [c["ones_zeros"].prefix(n), src["kv"].prefix(n)]
        return dsts, srcs, singles

    def _window(self, start: int) -> Prefixes:
        """Prefix cache of the ones-then-zeros window ``[start:]`` (at ``R - n``)."""
        cut = self._queries.get(start)
        if cut is None:
            cut = self._queries[start] = _cuts(self._ones_zeros[start:], False,
                                               self._builds)
        return cut

    def _table_rows(self, side: _ViewSide, n: int, p: int, dsts: List[Tensor],
                    srcs: List[Tensor], singles: List[Tuple[Tensor, Tensor]]) -> None:
        """``mha_block_table[:n]`` from ``block_table``, ``[n:p]`` from -1 rows."""
        cut = side.raw["mha_block_table"]
        c = self._consts
        if n:
            dst, source = cut.prefix(n), c["table"].prefix(n)
            if dst.dtype == source.dtype:
                dsts.append(word_view(dst))
                srcs.append(word_view(source))
            else:
                singles.append((dst, source))
        if p > n:
            w = side.width
            dst = cut.rows(n, p)
            minus = self._minus_rows.get(p - n)
            if minus is None:
                minus = self._minus_rows[p - n] = self._minus_one[:(p - n) * w].view(p - n, w)
            if dst.dtype == minus.dtype:
                dsts.append(dst)
                srcs.append(minus)
            else:
                singles.append((dst, minus))
