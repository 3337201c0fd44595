"""Shape-free staging of a draft depth on the mirror path (``MirrorBackend.decode_step``).

A draft depth's shadow has one fixed layout per view and forward ring: every field at
the depth capacity ``cap = min(R, view max_tokens, view max_requests)`` (a depth's
``padded <= cap``), at offsets that do not depend on the depth's ``(count, padded)``,
and no block-table rows. So the kernels' numpy arguments are built once per slot, and
the H2D copy is the slot's leading bytes up to the end of ``mha_cu_kv_seq_lengths[:p
+ 1]`` (the last field; the bytes past a field's written part are shipped, never
placed). The placement's ``(destination, source)`` pairs are prefixes of fixed
tensors, each cached by its own length (and slot, for the device stage), never by the
combination of lengths or by anything else: a trace whose counts keep changing builds
no layout and no plan, and at most one slice per new (tensor, length). Pairs are
grouped per call exactly as ``CopyPlan`` groups them (same ops: one
``_foreach_copy_`` per word dtype, a ``copy_`` per dtype conversion or lone pair).

Placement of a depth of ``n`` real rows padded to ``p`` (the same copies as
``MirrorBackend._placement``): block and local offset ``[:p]``; request, position and
pos id ``[:n]``; query/KV lengths ``[:p]``, their sums ``[:p + 1]``; table rows
``[:n]`` from the persistent device table, ``[n:p]`` from a device block of -1; the
persistent query/KV lengths ``[:n]`` from the staged lengths.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .cache import BoundedCache
from .gpu_view import ViewFields, ViewTarget, kernel_args, view_entries
from .layout import PackedLayout
from .placement import word_view

__all__ = ["DepthStage", "CommitStage", "run_grouped"]

_ALIGN = 8
_PAD_ROWS = ("token_to_block_idx", "token_to_local_position_within_kv_block")
_REAL_ROWS = ("token_to_request_idx", "token_to_position_in_request", "token_to_pos_ids")
_LENGTHS = ("mha_query_lengths", "mha_kv_seq_lengths")
_SUMS = ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths")
_FIELDS = _PAD_ROWS + _REAL_ROWS + _LENGTHS + _SUMS + ("mha_block_table",)
# Memory orders of the two fixed shadows (whatever VIEW_FIELDS' order): the field a
# forward's H2D copy ends in sits last.
_DEPTH = ("mha_block_table",) + _PAD_ROWS + _REAL_ROWS + _LENGTHS + _SUMS
_COMMIT = _LENGTHS + _SUMS + _REAL_ROWS + _PAD_ROWS + ("mha_block_table",)


class _Prefixes:
    """Prefixes ``[:k]`` (rows, for a 2-D tensor) of one tensor, as int32 words when
    the pair it belongs to copies words; cached by ``k`` in the stage's cache."""

    __slots__ = ("tensor", "scale", "key")

    def __init__(self, tensor: Tensor, words: bool, key: Any) -> None:
        viewed = word_view(tensor) if words else tensor
        self.tensor = viewed
        # Words per element along dim 0 of a 1-D tensor (an int64 field is 2 words).
        self.scale = viewed.shape[0] // max(tensor.shape[0], 1) if tensor.dim() == 1 \
            and tensor.shape[0] else 1
        self.key = key


def _words(dst: Tensor, src: Tensor) -> Tuple[bool, Optional[Tuple[torch.dtype, Any]]]:
    """``(as_words, group)`` of a pair, by ``CopyPlan``'s rule: a dtype or device change
    is a single (``group`` None); else both sides as int32 words when both can be, and
    the group is the dtype and device of what is copied."""
    if dst.dtype != src.dtype or dst.device != src.device:
        return False, None
    dw, sw = word_view(dst), word_view(src)
    as_words = dw.dtype == sw.dtype and dw.dim() == sw.dim() and \
        (dw.shape[-1] // max(dst.shape[-1], 1)) == (sw.shape[-1] // max(src.shape[-1], 1))
    dtype = dw.dtype if as_words else dst.dtype
    return as_words, (dtype, dst.device)


class _FixedStage:
    """A shadow layout of one view on one forward ring whose field offsets do not
    depend on the forward's shape, its per-slot kernel arguments and device fields,
    and the cached prefixes its placements use.

    ``entries`` are the layout's fields in memory order; the H2D copy of a forward
    ends at ``end_field``'s written part (``end_field``, the last field written, sits
    last). ``built`` counts what was built (the layout, argument sets, device field
    sets, H2D pairs, slices): a count test asserts it stops growing once every
    (tensor, length) of a trace was seen.
    """

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, entries: Any,
                 end_field: str, cap: int) -> None:
        self.layout = PackedLayout.build(entries, align=_ALIGN)
        self.cap = cap
        last = self.layout.names.index(end_field)
        self._end_base = self.layout.offsets[last]
        shape = self.layout.shapes[last]
        self._end_item = self.layout.dtypes[last].itemsize * (shape[1] if len(shape) > 1
                                                              else 1)
        self.ring = ring
        self.target = target
        self.buffers = buffers
        slots = ring.num_slots
        self._args: List[Optional[Tuple[Any, Any]]] = [None] * slots
        self._staged: List[Optional[Dict[str, _Prefixes]]] = [None] * slots
        self._h2d: List[Dict[int, Tuple[Tensor, Tensor]]] = [{} for _ in range(slots)]
        # Keys are (tensor, slot, length) with lengths <= the capacity, and the view's
        # row ranges: bounded by the capacity, never by the number of steps.
        self._cache = BoundedCache((slots + 2) * 16 * (cap + 2) + 4096)
        self.built = 1  # the layout
        view = target.fields
        staged0 = self.layout.tensors(ring.device_slots[0])
        self._modes: Dict[str, Tuple[bool, Any]] = {}
        for name in _FIELDS:
            self._modes[name] = _words(getattr(view, name), getattr(staged0, name))
        self._modes["table"] = _words(view.mha_block_table, buffers.block_table)
        self._modes["query_lengths"] = _words(buffers.query_lengths,
                                              staged0.mha_query_lengths)
        self._modes["kv_lengths"] = _words(buffers.kv_lengths, staged0.mha_kv_seq_lengths)
        self._view = {name: _Prefixes(getattr(view, name), self._modes[name][0],
                                      ("view", name)) for name in _FIELDS}
        self._view["table"] = _Prefixes(view.mha_block_table, self._modes["table"][0],
                                        ("view", "table"))
        self._buffer_table = _Prefixes(buffers.block_table, self._modes["table"][0],
                                       ("buffer", "table"))
        self._lengths = {
            "query_lengths": _Prefixes(buffers.query_lengths,
                                       self._modes["query_lengths"][0], ("buffer", "q")),
            "kv_lengths": _Prefixes(buffers.kv_lengths, self._modes["kv_lengths"][0],
                                    ("buffer", "kv"))}

    def args(self, slot: int) -> Tuple[Any, Any]:
        """The kernels' ``(token_args, request_args)`` numpy fields of ``slot``."""
        args = self._args[slot]
        if args is None:
            args = kernel_args(self.layout.arrays(self.ring.host_np[slot]))
            self._args[slot] = args
            self.built += 1
        return args

    def _prefix(self, prefixes: _Prefixes, count: int, slot: int = -1) -> Tensor:
        key = (prefixes.key, slot, count)
        value = self._cache.get(key)
        if value is None:
            value = prefixes.tensor[:count * prefixes.scale]
            self._cache.put(key, value)
            self.built += 1
        return value

    def _rows(self, prefixes: _Prefixes, start: int, stop: int) -> Tensor:
        """Rows ``[start:stop]`` of a 2-D ``prefixes`` tensor (the view's table)."""
        key = (prefixes.key, start, stop)
        value = self._cache.get(key)
        if value is None:
            value = prefixes.tensor[start:stop]
            self._cache.put(key, value)
            self.built += 1
        return value

    def _stage(self, slot: int) -> Dict[str, _Prefixes]:
        staged = self._staged[slot]
        if staged is None:
            fields = self.layout.tensors(self.ring.device_slots[slot])
            staged = {name: _Prefixes(getattr(fields, name), self._modes[name][0],
                                      ("stage", name)) for name in _FIELDS}
            staged["query_lengths"] = _Prefixes(fields.mha_query_lengths,
                                                self._modes["query_lengths"][0],
                                                ("stage", "q"))
            staged["kv_lengths"] = _Prefixes(fields.mha_kv_seq_lengths,
                                             self._modes["kv_lengths"][0],
                                             ("stage", "kv"))
            staged["table"] = _Prefixes(fields.mha_block_table, self._modes[
                "mha_block_table"][0], ("stage", "table"))
            self._staged[slot] = staged
            self.built += 1
        return staged

    def _ship(self, slot: int, written: int) -> Dict[str, _Prefixes]:
        """The H2D copy of ``slot`` up to ``written`` elements (rows) of the end field;
        returns the slot's device fields."""
        end = self._end_base + written * self._end_item
        h2d = self._h2d[slot].get(end)
        if h2d is None:
            h2d = (self.ring.device_slots[slot][:end], self.ring.slots[slot][:end])
            self._h2d[slot][end] = h2d
            self.built += 1
        h2d[0].copy_(h2d[1], non_blocking=True)
        return self._stage(slot)

    def _common(self, staged: Dict[str, _Prefixes], slot: int, tokens: int,
                real_tokens: int, requests: int) -> List[Tuple[Tensor, Tensor, Any]]:
        """The token and length pairs every staged forward places."""
        view, prefix, modes = self._view, self._prefix, self._modes
        pairs = []
        for name, count in ((_PAD_ROWS[0], tokens), (_PAD_ROWS[1], tokens),
                            (_REAL_ROWS[0], real_tokens), (_REAL_ROWS[1], real_tokens),
                            (_REAL_ROWS[2], real_tokens), (_LENGTHS[0], requests),
                            (_LENGTHS[1], requests), (_SUMS[0], requests + 1),
                            (_SUMS[1], requests + 1)):
            pairs.append((prefix(view[name], count), prefix(staged[name], count, slot),
                          modes[name][1]))
        return pairs


class DepthStage(_FixedStage):
    """A draft depth's fixed shadow: every field at ``cap`` rows, no table rows."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, minus_one: Tensor,
                 cap: int) -> None:
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {name: (name, dtype, (0, target.width)) if name == "mha_block_table"
                   else (name, dtype, shape)
                   for name, dtype, shape in view_entries(cap, cap, target.width, dtypes)}
        super().__init__(target, ring, buffers, tuple(by_name[name] for name in _DEPTH),
                         _DEPTH[-1], cap)
        self.minus_one = minus_one
        self._modes["pad"] = _words(target.fields.mha_block_table,
                                    minus_one[:target.width].view(1, target.width))
        self._view["pad"] = _Prefixes(target.fields.mha_block_table,
                                      self._modes["pad"][0], ("view", "pad"))

    @classmethod
    def fitting(cls, target: ViewTarget, ring: Any, buffers: Any, minus_one: Tensor,
                max_requests: int) -> Optional["DepthStage"]:
        """The stage at ``cap = min(R, view max_tokens, view max_requests)`` (a depth
        pads to at most that), or None when it does not fit one of ``ring``'s slots."""
        cap = min(max_requests, target.max_tokens, target.max_requests)
        stage = cls(target, ring, buffers, minus_one, cap)
        return stage if stage.layout.nbytes <= ring.slot_bytes else None

    def _pad_block(self, rows: int) -> Tensor:
        key = ("pad", rows)
        value = self._cache.get(key)
        if value is None:
            width = self.target.width
            value = self.minus_one[:rows * width].view(rows, width)
            if self._modes["pad"][0]:
                value = word_view(value)
            self._cache.put(key, value)
            self.built += 1
        return value

    def flush(self, slot: int, padded: int, count: int) -> None:
        """Copy ``slot``'s shadow of a depth of ``count`` rows padded to ``padded`` to
        its device stage (one H2D copy) and place it (the ops ``CopyPlan`` would
        issue). The caller records the slot's fence after."""
        staged = self._ship(slot, padded + 1)
        pairs = self._common(staged, slot, padded, count, padded)
        modes, prefix = self._modes, self._prefix
        table = self._view["table"]
        pairs.append((prefix(table, count), prefix(self._buffer_table, count),
                      modes["table"][1]))
        if padded > count:
            pairs.append((self._rows(self._view["pad"], count, padded),
                          self._pad_block(padded - count),
                          modes["pad"][1]))
        for name in ("query_lengths", "kv_lengths"):
            pairs.append((prefix(self._lengths[name], count),
                          prefix(staged[name], count, slot), modes[name][1]))
        run_grouped(pairs)


class CommitStage(_FixedStage):
    """A commit pass's fixed shadow: the request fields at ``requests`` rows (``+ 1``
    for the sums), then the token fields at ``cap`` tokens, then ``requests`` table
    rows, last, so the H2D copy ends at the table rows the pass writes."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, cap: int,
                 requests: int) -> None:
        dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
        by_name = {entry[0]: entry
                   for entry in view_entries(requests, cap, target.width, dtypes)}
        super().__init__(target, ring, buffers, tuple(by_name[name] for name in _COMMIT),
                         _COMMIT[-1], cap)
        self.requests = requests

    @classmethod
    def fitting(cls, target: ViewTarget, ring: Any, buffers: Any,
                max_requests: int) -> Optional["CommitStage"]:
        """The stage at ``min(R, view max_requests)`` request rows and the view's
        max_tokens, or as many tokens (at least ``R``) as one of ``ring``'s slots then
        holds; None when not even ``R`` tokens fit."""
        requests = min(max_requests, target.max_requests)
        stage = cls(target, ring, buffers, target.max_tokens, requests)
        if stage.layout.nbytes <= ring.slot_bytes:
            return stage
        bare = cls(target, ring, buffers, 0, requests)
        per_token = sum(dtype.itemsize for name, dtype in zip(bare.layout.names,
                                                              bare.layout.dtypes)
                        if name in _PAD_ROWS + _REAL_ROWS)
        cap = (ring.slot_bytes - bare.layout.nbytes - _ALIGN * 5) // per_token
        if cap < max_requests:
            return None
        stage = cls(target, ring, buffers, cap, requests)
        return stage if stage.layout.nbytes <= ring.slot_bytes else None

    def flush(self, slot: int, tokens: int, real_tokens: int, requests: int,
              staged_count: int, device_rows: int) -> None:
        """Ship and place a commit pass (``MirrorBackend._placement`` with
        ``to_lengths="query"``): table rows ``[:device_rows]`` from the persistent
        device table, ``[device_rows:requests]`` from the shadow's leading rows."""
        staged = self._ship(slot, requests - device_rows)
        pairs = self._common(staged, slot, tokens, real_tokens, requests)
        modes, prefix = self._modes, self._prefix
        table = self._view["table"]
        pairs.append((prefix(table, device_rows), prefix(self._buffer_table, device_rows),
                      modes["table"][1]))
        pairs.append((self._rows(self._view["mha_block_table"], device_rows, requests),
                      prefix(staged["table"], requests - device_rows, slot),
                      modes["mha_block_table"][1]))
        pairs.append((prefix(self._lengths["query_lengths"], staged_count),
                      prefix(staged["query_lengths"], staged_count, slot),
                      modes["query_lengths"][1]))
        run_grouped(pairs)


def run_grouped(pairs: List[Tuple[Tensor, Tensor, Any]]) -> None:
    """Issue ``(dst, src, group)`` copies as ``CopyPlan`` would: empty ones dropped,
    one ``_foreach_copy_`` per group of two or more, a ``copy_`` per single (group
    None) or lone member, groups first."""
    groups: Dict[Any, List[Tuple[Tensor, Tensor]]] = {}
    singles = []
    for dst, src, group in pairs:
        if dst.numel() == 0:
            continue
        if group is None:
            singles.append((dst, src))
        else:
            groups.setdefault(group, []).append((dst, src))
    for members in groups.values():
        if len(members) == 1:
            singles.append(members[0])
        else:
            torch._foreach_copy_([d for d, _ in members], [s for _, s in members],
                                 non_blocking=True)
    for dst, src in singles:
        dst.copy_(src, non_blocking=True)
