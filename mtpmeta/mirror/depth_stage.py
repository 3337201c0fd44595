"""``DepthStage``: a draft depth's fixed shadow on the forward ring (``stages``).

A depth of ``n`` rows padded to ``p`` places: block and local offset ``[:p]``;
request, position and pos id ``[:n]``; query/KV lengths ``[:p]``, their sums
``[:p + 1]``; table rows ``[:n]`` from the persistent device ``block_table`` (which
``begin_decode`` filled once per draft loop) and ``[n:p]`` from a device block of -1;
the persistent query/KV lengths ``[:n]``. The shadow holds no table rows, so a depth's
host work and H2D bytes follow ``p``, never ``W``; its H2D copy ends at
``mha_cu_kv_seq_lengths[:p + 1]``, the field it puts last.

The roles over ``n`` are built on first use (``stages``; the sources' once per ring for
every view), so a new view's first depth builds only its own ``n``'s views (building
every ``n <= cap`` ahead would cost about 40 ms per view at R 1024).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from mtpmeta.gpu_view import ViewFields, ViewTarget, view_entries
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.prefixes import Prefixes
from mtpmeta.mirror.stages import (COMMON, LENGTHS, PADDED, REAL_ROLES, SUMMED, TABLE,
                                   FixedStage, copy_mode)

__all__ = ["DepthStage"]

# Memory order: the table (no rows), then COMMON, so the H2D copy ends in the sums.
_ORDER = (TABLE,) + COMMON
# The roles over n: request index, position, pos id, then the extra pairs (table rows,
# persistent query and KV lengths).
_COUNT_ROLES = REAL_ROLES + (len(COMMON), len(COMMON) + 1, len(COMMON) + 2)
# The roles by the length they are placed over: p (block, local offset, both lengths),
# n, p + 1 (both sums).
_CLASSES = ((0, 1, PADDED, PADDED + 1), _COUNT_ROLES, (SUMMED, SUMMED + 1))


class DepthStage(FixedStage):
    """A draft depth's fixed shadow: every field at ``cap`` rows (``cap = min(R, view
    max_tokens, view max_requests)``), ``mha_block_table`` at ``[0, W]``. Pad table
    rows come from ``minus_one`` (``[R * W]`` int32 of -1 on the device), as
    ``[rows, W]`` blocks cached per row count."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, minus_one: Tensor,
                 cap: int) -> None:
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {name: (name, dtype, (0, target.width)) if name == TABLE
                   else (name, dtype, shape)
                   for name, dtype, shape in view_entries(cap, cap, target.width, dtypes)}
        table = target.fields.mha_block_table
        super().__init__(target, ring, buffers, tuple(by_name[name] for name in _ORDER),
                         cap, {"table": (table, buffers.block_table),
                               "query_lengths": (buffers.query_lengths, LENGTHS[0]),
                               "kv_lengths": (buffers.kv_lengths, LENGTHS[1])},
                         _CLASSES)
        width = target.width
        pad_words, pad_group = copy_mode(table, minus_one[:width].view(1, width))
        self._pad_view = Prefixes(table, pad_words, self._counter)
        self._pad_group = self._group(pad_group)
        self._pad_words = pad_words
        self._minus_one = minus_one
        self._pad_blocks: Dict[int, Tensor] = {}
        self._width = width
        self._seal()

    def _extra_groups(self) -> List[int]:
        return [self._pad_group]

    @classmethod
    def fitting(cls, target: ViewTarget, ring: Any, buffers: Any, minus_one: Tensor,
                max_requests: int) -> Optional["DepthStage"]:
        """The stage at ``cap = min(R, view max_tokens, view max_requests)`` (a depth
        pads to at most that), or None when it does not fit one of ``ring``'s slots."""
        cap = min(max_requests, target.max_tokens, target.max_requests)
        stage = cls(target, ring, buffers, minus_one, cap)
        if stage.layout.nbytes > ring.slot_bytes:
            return None
        return stage

    def _pad_block(self, rows: int) -> Tensor:
        value = self._pad_blocks.get(rows)
        if value is None:
            value = self._minus_one[:rows * self._width].view(rows, self._width)
            if self._pad_words:
                value = word_view(value)
            self._pad_blocks[rows] = value
            self._counter[0] += 1
        return value

    def flush(self, slot: int, padded: int, count: int) -> None:
        """Copy ``slot``'s shadow of a depth of ``count`` rows padded to ``padded`` to
        the zone (one H2D copy) and place it. The caller entered the backend's
        ``StreamOrder`` first and records the slot's fence after."""
        shipped = self._ship(slot, padded + 1)
        if not self._single_group:
            extra = [] if padded == count else [
                (self._pad_view.rows(count, padded), self._pad_block(padded - count),
                 self._pad_group)]
            return self._place_lengths(shipped, (padded, count, padded + 1), extra)
        pads, rows, sums = shipped[1]  # _place_lengths' joins, unrolled: every depth
        pad = pads.cache.get(padded) or pads.build(padded)
        real = rows.cache.get(count) or rows.build(count)
        summed = sums.cache.get(padded + 1) or sums.build(padded + 1)
        dsts, srcs = pad[0] + real[0] + summed[0], pad[1] + real[1] + summed[1]
        if padded != count:
            dsts.append(self._pad_view.rows(count, padded))
            srcs.append(self._pad_block(padded - count))
        torch._foreach_copy_(dsts, srcs, non_blocking=True)  # the sums: >= 2 pairs
