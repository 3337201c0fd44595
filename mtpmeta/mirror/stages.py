"""Shape-free staging of draft depths and commit passes on the mirror path.

Each kind of forward has one fixed shadow layout per view and forward ring
(``DepthStage``, ``CommitStage``): every field at a capacity, at offsets that do not
depend on the forward's counts. So the kernels' numpy arguments and the slot's typed
device fields are built once per slot, and nothing is built per shape:

* the H2D copy is the slot's leading bytes up to the written part of the field that
  sits last (a depth's ``mha_cu_kv_seq_lengths[:p + 1]``, a commit pass's table rows):
  the bytes past another field's written part are shipped, never placed (the
  zone's prefix per length is shared by the slots, the slot's own per slot);
* every slot's H2D copy lands in ONE device landing zone (the ring's ``zone``), so the
  placement's ``(destination, source)`` pairs are prefixes of fixed tensors shared by
  all slots, each cached by its own length, never by the slot or the combination of
  lengths: once a trace's lengths were seen, it builds no layout, plan or slice at
  all, whatever its mix of counts and slots;
* the zone is rewritten by the next forward's H2D copy while nothing orders that copy
  after this one's placement but the stream: callers enter the persistent buffers'
  ``StreamOrder`` first (``MirrorBackend.refuse_capture``), so on a change of stream
  the new stream waits on an event recorded after the placement on the old one. The
  pinned host slot stays fenced per slot (its fence is recorded after the placement);
* a commit pass's real token count ``T`` is new at almost every step (pad tokens'
  request, position and pos id stay as they were, so those three copies run over
  exactly ``T``): a commit stage builds their prefixes for every ``T <= min(cap,
  PREBUILT_TOKENS)`` when it is built (six views per token: 65-95 ms for 4,096), and a
  depth stage those over the real row count ``n`` for every ``n <= cap`` (about 40 ms
  at R 1024); the roles over padded counts are built on first use (bucketed counts);
* a pass with block counts (``flush_counted``) lands in the slot's own device stage
  instead (fenced with the slot), its sources per slot;
* pairs are grouped as ``CopyPlan`` groups them (the same ops: one ``_foreach_copy_``
  per word dtype and device, a ``copy_`` per dtype conversion or lone pair, groups
  first, empty pairs dropped), from groups fixed per view; with one group (the usual
  case) as a few cached lists joined (``PrefixGroup``), not two look-ups per pair.

The copies are those of ``MirrorBackend._placement``. A depth of ``n`` rows padded to
``p``: block and local offset ``[:p]``; request, position and pos id ``[:n]``;
query/KV lengths ``[:p]``, their sums ``[:p + 1]``; table rows ``[:n]`` from the
persistent device table and ``[n:p]`` from a device block of -1; the persistent
query/KV lengths ``[:n]``. A commit pass of ``T`` tokens padded to ``t``, ``r``
request slots, ``m`` staged lengths and ``d`` device rows: tokens as a depth's over
``t`` and ``T``, lengths over ``r``, table rows ``[:d]`` from the persistent table and
``[d:r]`` from the shadow, the persistent query lengths ``[:m]``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.gpu_view import ViewFields, ViewTarget, kernel_args, view_entries
from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.prefixes import PrefixGroup, Prefixes

__all__ = ["DepthStage", "CommitStage"]

_ALIGN = 8
#: A commit stage builds the prefixes ``[:T]`` of its three real-token roles for every
#: ``T`` up to this many tokens when it is built (module docstring).
PREBUILT_TOKENS = 4096
_PAD_ROWS = ("token_to_block_idx", "token_to_local_position_within_kv_block")
_REAL_ROWS = ("token_to_request_idx", "token_to_position_in_request", "token_to_pos_ids")
_LENGTHS = ("mha_query_lengths", "mha_kv_seq_lengths")
_SUMS = ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths")
_TABLE = "mha_block_table"
# The nine pairs every staged forward places, in order: (view field, staged field).
_COMMON = _PAD_ROWS + _REAL_ROWS + _LENGTHS + _SUMS
# The roles (indices into a stage's roles: _COMMON, then its extra pairs) placed over
# the real token count of a pass, and over the real row count n of a depth (its
# real-token rows, table rows and persistent query/KV lengths).
_REAL_ROLES = tuple(range(len(_PAD_ROWS), len(_PAD_ROWS) + len(_REAL_ROWS)))
_DEPTH_COUNT_ROLES = _REAL_ROLES + (len(_COMMON), len(_COMMON) + 1, len(_COMMON) + 2)
# The roles by the length they are placed over (``_place_lengths``). A depth: its
# padded count p (block, local offset, both lengths), n, p + 1 (both sums). A commit
# pass: padded tokens, real tokens, request slots (lengths), slots + 1 (sums), device
# rows, staged lengths.
_PADDED, _SUMMED = _COMMON.index(_LENGTHS[0]), _COMMON.index(_SUMS[0])
_DEPTH_CLASSES = ((0, 1, _PADDED, _PADDED + 1), _DEPTH_COUNT_ROLES, (_SUMMED, _SUMMED + 1))
_COMMIT_CLASSES = ((0, 1), _REAL_ROLES, (_PADDED, _PADDED + 1), (_SUMMED, _SUMMED + 1),
                   (len(_COMMON),), (len(_COMMON) + 1,))
_REAL_CLASS = 1  # in both: the class placed over the real count (n rows, T tokens)
# Memory orders of the two fixed shadows (whatever VIEW_FIELDS' order): the field a
# forward's H2D copy ends in sits last.
_DEPTH = (_TABLE,) + _COMMON
_COMMIT = _LENGTHS + _SUMS + _REAL_ROWS + _PAD_ROWS + (_TABLE,)


def _mode(dst: Tensor, src: Tensor) -> Tuple[bool, Any]:
    """``(as_words, group)`` of a pair, by ``CopyPlan``'s rule: a dtype or device change
    is a single (``group`` None); else both sides as int32 words when both can be read
    so, grouped by the dtype and device of what is copied."""
    if dst.dtype != src.dtype or dst.device != src.device:
        return False, None
    dw, sw = word_view(dst), word_view(src)
    as_words = dw.dtype == sw.dtype and dw.dim() == sw.dim() and \
        dw.shape[-1] * src.shape[-1] == sw.shape[-1] * dst.shape[-1]
    return as_words, (dw.dtype if as_words else dst.dtype, dst.device)


class _FixedStage:
    """A fixed shadow layout (``entries`` in memory order, the H2D copy ending in
    ``entries[-1]``) of one view on one forward ring, its per-slot kernel arguments,
    its fields in the ring's zone, and the prefixes its placements use. ``built`` counts what was built
    (the layout, argument sets, device field sets, H2D pairs, prefixes): it stops
    growing once every (tensor, length) of a trace was seen."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, entries: Any,
                 cap: int, extra: Dict[str, Tuple[Tensor, str]],
                 classes: Tuple[Tuple[int, ...], ...]) -> None:
        """``extra``: pairs besides ``_COMMON``, by role: ``(destination, staged field
        name or None)``; a role's source is then ``extra_sources[role]``. ``classes``:
        the roles by the length they are placed over (each role in one)."""
        self.layout = PackedLayout.build(entries, align=_ALIGN)
        self.cap = cap
        last = len(entries) - 1
        shape = self.layout.shapes[last]
        self._end_base = self.layout.offsets[last]
        self._end_item = self.layout.dtypes[last].itemsize * (
            shape[1] if len(shape) > 1 else 1)
        self.ring = ring
        self._counter = [1]  # the layout
        slots = ring.num_slots
        self._args: List[Optional[Tuple[Any, Any]]] = [None] * slots
        # Per slot, its H2D copies by (end, packed): into the zone, or packed
        # (``_packed_end``) into its own device stage.
        self._h2d: List[Dict[Tuple[int, bool], Tuple[Tensor, Tensor]]] = [
            {} for _ in range(slots)]
        # Per slot, the roles and classes over its own device stage (flush_counted).
        self._slot_shipped: List[Optional[Tuple[list, list]]] = [None] * slots
        fields = target.fields
        self._zone = self.layout.tensors(ring.zone)  # the staged fields in the zone
        self._zone_bytes = Prefixes(ring.zone, False, self._counter)  # H2D ends, shared
        # Role -> (destination, source in the zone, staged field or None).
        self._pairs = [(getattr(fields, name), getattr(self._zone, name), name)
                       for name in _COMMON]
        self._pairs += [(dst, getattr(self._zone, src) if isinstance(src, str) else src,
                         src if isinstance(src, str) else None)
                        for dst, src in extra.values()]
        modes = [_mode(dst, src) for dst, src, _ in self._pairs]
        self._group_keys: List[Any] = []
        self._group_ids = [self._group(group) for _, group in modes]
        self._dsts = [Prefixes(dst, words, self._counter)
                      for (dst, _, _), (words, _) in zip(self._pairs, modes)]
        self._words = [words for words, _ in modes]
        # Sources that are not staged (persistent buffers) are shared by all slots.
        self._fixed_srcs = [None if name is not None else
                            Prefixes(src, words, self._counter)
                            for (_, src, name), words in zip(self._pairs, self._words)]
        self._class_roles = classes
        # The roles (and classes) of a pass landed in the zone: shared by every slot.
        self._zone_shipped = PrefixGroup.classes(self._staged_roles(self._zone), classes,
                                                 self._counter)

    def _staged_roles(self, staged: Any) -> List[Tuple[Prefixes, Prefixes, int]]:
        """``(destination, source, group)`` per role, staged sources in ``staged``."""
        return [(dst, fixed if fixed is not None else
                 Prefixes(getattr(staged, name), words, self._counter), group)
                for dst, fixed, (_, _, name), words, group in zip(
                    self._dsts, self._fixed_srcs, self._pairs, self._words,
                    self._group_ids)]

    def _prebuilt(self, upto: int) -> Any:
        """This stage with the zone's real-count class built for every ``k <= upto``
        (its pairs' prefixes ``[:k]`` and their lists), returned."""
        self._zone_shipped[1][_REAL_CLASS].fill(upto)
        return self

    def _group(self, key: Any) -> int:
        """The index of the copy group ``key`` (``_mode``'s), -1 for a single."""
        if key is None:
            return -1
        if key not in self._group_keys:
            self._group_keys.append(key)
        return self._group_keys.index(key)

    @property
    def built(self) -> int:
        return self._counter[0]

    def args(self, slot: int) -> Tuple[Any, Any]:
        """The kernels' ``(token_args, request_args)`` numpy fields of ``slot``."""
        args = self._args[slot]
        if args is None:
            args = kernel_args(self.layout.arrays(self.ring.host_np[slot]))
            self._args[slot] = args
            self._counter[0] += 1
        return args

    def _ship(self, slot: int, written: int, *,
              packed_bytes: Optional[int] = None) -> Tuple[list, List[PrefixGroup]]:
        """Issue the H2D copy of ``slot`` up to ``written`` elements (rows) of the last
        field into the zone, and return the zone's roles ``(destination, source,
        group)`` and classes; or, with ``packed_bytes``, at least that many bytes of the
        last field into the slot's own device stage (``_packed_end``: up to 1/8 more, of
        the slot's own bytes, which nothing reads there), and the slot's roles. The caller
        entered the backend's ``StreamOrder`` first (module docstring)."""
        packed = packed_bytes is not None
        end = self._packed_end(packed_bytes) if packed else \
            self._end_base + written * self._end_item
        h2d = self._h2d[slot].get((end, packed))
        if h2d is None:
            h2d = (self.ring.device_slots[slot][:end] if packed else
                   self._zone_bytes.prefix(end), self.ring.slots[slot][:end])
            self._h2d[slot][(end, packed)] = h2d
            self._counter[0] += 1
        h2d[0].copy_(h2d[1], non_blocking=True)
        if not packed:
            return self._zone_shipped
        shipped = self._slot_shipped[slot]
        if shipped is None:
            shipped = PrefixGroup.classes(self._staged_roles(self.layout.tensors(
                self.ring.device_slots[slot])), self._class_roles, self._counter)
            self._slot_shipped[slot] = shipped
            self._counter[0] += 1
        return shipped

    def _packed_end(self, packed_bytes: int) -> int:
        """The end of a packed H2D copy of ``packed_bytes`` table bytes, rounded up to a
        multiple of 1/16 of their power of two (about 8 ends per octave), in the layout."""
        step = max(1 << max(packed_bytes.bit_length() - 4, 0), _ALIGN)
        return min(self._end_base + -(-packed_bytes // step) * step, self.layout.nbytes)

    def _place(self, roles: List[Tuple[Prefixes, Prefixes, int]], counts: Tuple[int, ...],
               extra: List[Tuple[Tensor, Tensor, int]]) -> None:
        """Issue the copies: role ``i`` over ``[:counts[i]]`` (0: dropped), then the
        ``extra`` ``(destination, source, group)`` pairs, grouped as ``CopyPlan``."""
        groups: List[Tuple[List[Tensor], List[Tensor]]] = [
            ([], []) for _ in self._group_keys]
        singles, pairs = [], []
        for (dst_p, src_p, group), count in zip(roles, counts):
            if count:
                dst, src = dst_p.cache.get(count), src_p.cache.get(count)
                pairs.append((dst_p.build(count) if dst is None else dst,
                              src_p.build(count) if src is None else src, group))
        for dst, src, group in pairs + list(extra):
            if group < 0:
                singles.append((dst, src))
            else:
                groups[group][0].append(dst)
                groups[group][1].append(src)
        for group_dsts, group_srcs in groups:
            if len(group_dsts) > 1:
                torch._foreach_copy_(group_dsts, group_srcs, non_blocking=True)
            elif group_dsts:
                singles.append((group_dsts[0], group_srcs[0]))
        for dst, src in singles:
            dst.copy_(src, non_blocking=True)

    def _place_lengths(self, shipped: Tuple[list, List[PrefixGroup]],
                       lengths: Tuple[int, ...],
                       extra: List[Tuple[Tensor, Tensor, int]]) -> None:
        """``_place`` of ``shipped`` (``_ship``'s roles and classes), class ``i`` over
        ``[:lengths[i]]``: with one copy group (the usual case), each class's pairs as
        two cached lists (``PrefixGroup``), joined, then ``extra``; else by ``_place``."""
        roles, classes = shipped
        if not self._single_group:
            counts = [0] * len(roles)
            for members, length in zip(self._class_roles, lengths):
                for index in members:
                    counts[index] = length
            self._place(roles, tuple(counts), extra)
            return
        dsts: List[Tensor] = []
        srcs: List[Tensor] = []
        for group, length in zip(classes, lengths):
            pairs = group.cache.get(length) or group.build(length)
            dsts += pairs[0]
            srcs += pairs[1]
        for dst, src, _ in extra:
            dsts.append(dst)
            srcs.append(src)
        if len(dsts) > 1:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        elif dsts:
            dsts[0].copy_(srcs[0], non_blocking=True)

    def _seal(self) -> None:
        """Called by a subclass once its extra pairs' groups are registered."""
        self._single_group = len(self._group_keys) == 1 and min(self._group_ids) == 0 \
            and all(group == 0 for group in self._extra_groups())

    def _extra_groups(self) -> List[int]:
        return []


class DepthStage(_FixedStage):
    """A draft depth's fixed shadow: every field at ``cap`` rows, no table rows."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, minus_one: Tensor,
                 cap: int) -> None:
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {name: (name, dtype, (0, target.width)) if name == _TABLE
                   else (name, dtype, shape)
                   for name, dtype, shape in view_entries(cap, cap, target.width, dtypes)}
        table = target.fields.mha_block_table
        super().__init__(target, ring, buffers, tuple(by_name[name] for name in _DEPTH),
                         cap, {"table": (table, buffers.block_table),
                               "query_lengths": (buffers.query_lengths, _LENGTHS[0]),
                               "kv_lengths": (buffers.kv_lengths, _LENGTHS[1])},
                         _DEPTH_CLASSES)
        width = target.width
        pad_words, pad_group = _mode(table, minus_one[:width].view(1, width))
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
        return stage._prebuilt(cap)

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


class CommitStage(_FixedStage):
    """A commit pass's fixed shadow: the request fields at ``requests`` rows (``+ 1``
    for the sums), then the token fields at ``cap`` tokens, then ``requests`` table
    rows, last, so the H2D copy ends at the table rows the pass writes."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, cap: int,
                 requests: int, device_table: Tensor) -> None:
        table = target.fields.mha_block_table
        super().__init__(target, ring, buffers, self._entries(target, cap, requests),
                         cap, {"table": (table, device_table),
                               "query_lengths": (buffers.query_lengths, _LENGTHS[0])},
                         _COMMIT_CLASSES)
        self.requests = requests
        self._whole_rows: Dict[Tuple[int, int], Tuple[Tensor, Tensor, int]] = {}
        words, group = _mode(table,
                             self.layout.tensors(ring.device_slots[0]).mha_block_table)
        self._rows_view = Prefixes(table, words, self._counter)
        self._rows_src = Prefixes(self._zone.mha_block_table, words, self._counter)
        self._table_field = table  # the view's mha_block_table [R, W]
        self._counted_groups: List[int] = []  # distinct groups of flush_counted rows
        # (slot, C) -> (the view's mha_block_table[:, :C], the slot's staged table
        # region as [rows, C]): a packed pass's strided copy, row prefixes of these.
        self._packed_pairs: Dict[Tuple[int, int], Tuple[Tensor, Tensor]] = {}
        # A counted pass's packed rows per slot (mirror_counts): each row's count (the
        # columns from it on hold D) and how many leading rows that holds for, valid
        # while the ring's mark for the slot is packed_mark(C).
        self.known = [np.zeros(requests + 1, dtype=np.int32) for _ in range(ring.num_slots)]
        self.known_rows = [0] * ring.num_slots
        self._rows_words = words
        self._rows_group = self._group(group)
        self._seal()

    @classmethod
    def fitting(cls, target: ViewTarget, ring: Any, buffers: Any, max_requests: int,
                device_table: Tensor) -> Optional["CommitStage"]:
        """The stage at ``min(R, view max_requests)`` request rows and the view's
        max_tokens, or as many tokens (at least ``R``) as one of ``ring``'s slots then
        holds; None when not even ``R`` tokens fit. Sized from its layout alone, as its
        fields are views over the ring's zone (one slot's bytes). ``device_table``
        ``[R, W]``: the private reuse table a pass's leading rows are placed from."""
        requests = min(max_requests, target.max_requests)
        def layout(cap: int) -> PackedLayout:
            return PackedLayout.build(cls._entries(target, cap, requests), align=_ALIGN)
        cap = target.max_tokens
        if layout(cap).nbytes > ring.slot_bytes:
            bare = layout(0)
            per_token = sum(dtype.itemsize for name, dtype in zip(bare.names, bare.dtypes)
                            if name in _PAD_ROWS + _REAL_ROWS)
            cap = (ring.slot_bytes - bare.nbytes - _ALIGN * 5) // per_token
            if cap < max_requests or layout(cap).nbytes > ring.slot_bytes:
                return None
        return cls(target, ring, buffers, cap, requests, device_table)._prebuilt_tokens()

    @staticmethod
    def _entries(target: ViewTarget, cap: int, requests: int) -> tuple:
        """The stage's ``(name, dtype, shape)`` entries in memory order (``_COMMIT``) at
        ``requests`` rows and ``cap`` tokens, in the dtypes of ``target``'s view."""
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {e[0]: e for e in view_entries(requests, cap, target.width, dtypes)}
        return tuple(by_name[name] for name in _COMMIT)

    def _prebuilt_tokens(self) -> "CommitStage":
        """This stage with every prefix of its real-token roles built (up to
        ``PREBUILT_TOKENS`` tokens; module docstring), returned."""
        return self._prebuilt(min(self.cap, PREBUILT_TOKENS))

    def flush(self, slot: int, tokens: int, real_tokens: int, requests: int,
              staged_count: int, device_rows: int) -> None:
        """Ship and place a commit pass: table rows ``[:device_rows]`` from the
        stage's ``device_table``, ``[device_rows:requests]`` from the shadow. The
        caller entered the backend's ``StreamOrder`` first and records the slot's
        fence after."""
        shadow_rows = requests - device_rows
        shipped = self._ship(slot, shadow_rows)
        extra = []
        if shadow_rows:
            source = self._rows_src
            src = source.cache.get(shadow_rows)
            if src is None:
                src = source.build(shadow_rows)
            extra.append((self._rows_view.rows(device_rows, requests), src,
                          self._rows_group))
        self._place_lengths(shipped, (tokens, real_tokens, requests, requests + 1,
                                      device_rows, staged_count), extra)

    def flush_counted(self, slot: int, tokens: int, real_tokens: int, requests: int,
                      staged_count: int, columns: int,
                      wholes: List[Tuple[Tensor, int, int]]) -> None:
        """Ship and place a commit pass with packed rows (``mirror_counts``): the
        shadow's table region holds the packed ``[staged_count, columns]`` rows;
        ``wholes``, ``(device block of one value, start, stop)`` row ranges (the
        caller's: its fill past the counts, the pad rows' -1), join the grouped copy
        as whole rows, then one strided copy lays the packed rows over
        ``[:staged_count, :columns]``. The caller records the slot's fence after."""
        last = len(self.layout.names) - 1
        width = self.layout.shapes[last][1]
        shipped = self._ship(slot, 0, packed_bytes=staged_count * columns
                             * self.layout.dtypes[last].itemsize)
        extra = [self._whole(block, start, stop, width) for block, start, stop in wholes
                 if stop > start]
        self._place_lengths(shipped, (tokens, real_tokens, requests, requests + 1, 0,
                                      staged_count), extra)
        if staged_count:
            pair = self._packed_pairs.get((slot, columns))
            if pair is None:  # the view's first C columns, the slot's region as C-rows
                flat = self.layout.tensors(self.ring.device_slots[slot]) \
                    .mha_block_table.view(-1)
                rows = flat.shape[0] // columns
                pair = (self._table_field[:, :columns],
                        flat[:rows * columns].view(rows, columns))
                self._packed_pairs[(slot, columns)] = pair
                self._counter[0] += 1
            pair[0][:staged_count].copy_(pair[1][:staged_count], non_blocking=True)

    def _extra_groups(self) -> List[int]:
        return [self._rows_group] + self._counted_groups

    def packed_mark(self, columns: int, fill: int) -> tuple:
        """The ring mark of a slot whose table region (from ``_end_base`` on) holds
        this stage's packed rows at ``columns`` columns, ``fill`` past their counts."""
        return (self._end_base, self, columns, fill)

    def _whole(self, block: Tensor, start: int, stop: int,
               width: int) -> Tuple[Tensor, Tensor, int]:
        """``(view rows [start:stop], the block's first rows, group)``: whole rows from
        a device block of one value, cached by ``(start, stop)`` and the block."""
        key = (start, stop, block.data_ptr())
        pair = self._whole_rows.get(key)
        if pair is None:
            dst = self._table_field[start:stop]
            src = block[:(stop - start) * width].view(stop - start, width)
            words, group = _mode(dst, src)
            if words:
                dst, src = word_view(dst), word_view(src)
            pair = (dst, src, self._group(group))
            if pair[2] not in self._counted_groups:
                self._counted_groups.append(pair[2])
            self._whole_rows[key] = pair
            self._counter[0] += 1
            self._seal()
        return pair
