"""``FixedStage``: one fixed shadow layout of one view on the forward ring, the base of
``DepthStage`` (``depth_stage``) and ``CommitStage`` (``commit_stage``).

A stage puts every field at a capacity, at offsets that do not depend on a forward's
counts. So the kernels' numpy arguments and the slot's typed device fields are built
once per slot, and nothing is built per shape:

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
* every prefix is built on first use, so a new view's first forward builds only the
  prefixes of its own counts (a new view costs little); the sources' prefixes (the
  zone's fields, the persistent buffers) do not depend on the view and are built once
  per ring for the stages of every view (``shared_prefixes``);
* a pass with block counts (``CommitStage.flush_counted``) lands in the slot's own
  device stage instead (fenced with the slot), its sources per slot;
* pairs are grouped as ``CopyPlan`` groups them (the same ops: one ``_foreach_copy_``
  per word dtype and device, a ``copy_`` per dtype conversion or lone pair, groups
  first, empty pairs dropped), from groups fixed per view; with one group (the usual
  case) as a few cached lists joined (``PrefixGroup``), not two look-ups per pair.

The copies are those ``copy_plan.forward_pairs`` lists for the per-shape route.

Roles: a stage's pairs are ``COMMON`` (the nine fields every staged forward places, in
this order), then the subclass's extra pairs; a class is the roles placed over one
length (``_place_lengths``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from mtpmeta.gpu_view import ViewTarget, kernel_args
from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.mirror.copy_plan import word_view
from mtpmeta.mirror.prefixes import PrefixGroup, Prefixes

__all__ = ["FixedStage", "copy_mode", "ALIGN", "PAD_ROWS", "REAL_ROWS", "LENGTHS", "SUMS",
           "TABLE", "COMMON", "REAL_ROLES", "PADDED", "SUMMED", "shared_prefixes"]

ALIGN = 8  # bytes: every field of a stage starts at a multiple
PAD_ROWS = ("token_to_block_idx", "token_to_local_position_within_kv_block")
REAL_ROWS = ("token_to_request_idx", "token_to_position_in_request", "token_to_pos_ids")
LENGTHS = ("mha_query_lengths", "mha_kv_seq_lengths")
SUMS = ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths")
TABLE = "mha_block_table"
# The nine pairs every staged forward places, in order: (view field, staged field).
COMMON = PAD_ROWS + REAL_ROWS + LENGTHS + SUMS
# The roles (indices into a stage's roles: COMMON, then its extra pairs) placed over
# the real count: request index, position and pos id.
REAL_ROLES = tuple(range(len(PAD_ROWS), len(PAD_ROWS) + len(REAL_ROWS)))
# The roles of the first length and of the first cumulative sum.
PADDED, SUMMED = COMMON.index(LENGTHS[0]), COMMON.index(SUMS[0])


def shared_prefixes(ring: Any, tensor: Tensor, words: bool, in_zone: bool = False
                    ) -> Prefixes:
    """The ``Prefixes`` of ``tensor``, a view-independent source (``in_zone``: a view
    of ``ring``'s zone, else a persistent buffer or the zone itself), shared by the
    stages of every view on ``ring`` and dropped with it. Keyed by the tensor's
    identity (the entry keeps it alive), or for a view of the zone (made anew by each
    stage's layout) by its place in the zone."""
    key: Any = ("zone", tensor.storage_offset(), tensor.dtype, tuple(tensor.shape),
                tensor.stride(), words) if in_zone else (id(tensor), words)
    entry = ring.shared_prefixes.get(key)
    if entry is None:  # (the tensor, kept alive so its id names it, its prefixes)
        entry = (tensor, Prefixes(tensor, words, ring.shared_built))
        ring.shared_prefixes[key] = entry
    return entry[1]


def copy_mode(dst: Tensor, src: Tensor) -> Tuple[bool, Any]:
    """``(as_words, group)`` of a pair, by ``CopyPlan``'s rule: a dtype or device change
    is a single (``group`` None); else both sides as int32 words when both can be read
    so, grouped by the dtype and device of what is copied."""
    if dst.dtype != src.dtype or dst.device != src.device:
        return False, None
    dw, sw = word_view(dst), word_view(src)
    as_words = dw.dtype == sw.dtype and dw.dim() == sw.dim() and \
        dw.shape[-1] * src.shape[-1] == sw.shape[-1] * dst.shape[-1]
    return as_words, (dw.dtype if as_words else dst.dtype, dst.device)


class FixedStage:
    """A fixed shadow layout of one view on one forward ring: ``layout`` (``entries`` in
    memory order, the H2D copy ending in ``entries[-1]``), each slot's kernel
    arguments (``args``), the staged fields in the ring's ``zone``, and the prefixes
    its placements use (``Prefixes``, ``PrefixGroup``).

    Invariant: a role's destination and source prefixes depend on its length only,
    never on the slot (every slot lands in the zone), so ``built`` (the layout,
    argument sets, device field sets, H2D pairs and prefixes built so far) stops
    growing once every (tensor, length) of a trace was seen. A subclass registers its
    extra pairs' copy groups, then calls ``_seal``."""

    def __init__(self, target: ViewTarget, ring: Any, buffers: Any, entries: Any,
                 cap: int, extra: Dict[str, Tuple[Tensor, str]],
                 classes: Tuple[Tuple[int, ...], ...]) -> None:
        """``entries``: ``(name, dtype, shape)`` in memory order; ``cap``: the token
        (or row) capacity; ``extra``: the pairs after ``COMMON``, by role name, each
        ``(destination, source)`` with the source a staged field's name or a device
        tensor (a persistent buffer, shared by all slots); ``classes``: the roles by the
        length they are placed over (each role in exactly one)."""
        self.layout = PackedLayout.build(entries, align=ALIGN)
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
        self._zone_bytes = shared_prefixes(ring, ring.zone, False)  # H2D ends
        # Role -> (destination, source in the zone, staged field or None).
        self._pairs = [(getattr(fields, name), getattr(self._zone, name), name)
                       for name in COMMON]
        self._pairs += [(dst, getattr(self._zone, src) if isinstance(src, str) else src,
                         src if isinstance(src, str) else None)
                        for dst, src in extra.values()]
        modes = [copy_mode(dst, src) for dst, src, _ in self._pairs]
        self._group_keys: List[Any] = []
        self._group_ids = [self._group(group) for _, group in modes]
        self._dsts = [Prefixes(dst, words, self._counter)
                      for (dst, _, _), (words, _) in zip(self._pairs, modes)]
        self._words = [words for words, _ in modes]
        # Sources that are not staged (persistent buffers) are shared by all slots.
        self._fixed_srcs = [None if name is not None else shared_prefixes(ring, src, words)
                            for (_, src, name), words in zip(self._pairs, self._words)]
        self._class_roles = classes
        # The roles (and classes) of a pass landed in the zone: shared by every slot.
        self._zone_shipped = PrefixGroup.classes(self._staged_roles(self._zone, True),
                                                 classes, self._counter)

    def _staged_roles(self, staged: Any, zone: bool = False
                      ) -> List[Tuple[Prefixes, Prefixes, int]]:
        """``(destination, source, group)`` per role, staged sources in ``staged``
        (``zone``: the ring's zone, whose prefixes every view's stages share)."""
        def source(name: str, words: bool) -> Prefixes:
            tensor = getattr(staged, name)
            return shared_prefixes(self.ring, tensor, words, True) if zone else \
                Prefixes(tensor, words, self._counter)
        return [(dst, fixed if fixed is not None else source(name, words), group)
                for dst, fixed, (_, _, name), words, group in zip(
                    self._dsts, self._fixed_srcs, self._pairs, self._words,
                    self._group_ids)]

    def _group(self, key: Any) -> int:
        """The index of the copy group ``key`` (``copy_mode``'s), -1 for a single."""
        if key is None:
            return -1
        if key not in self._group_keys:
            self._group_keys.append(key)
        return self._group_keys.index(key)

    @property
    def built(self) -> int:
        """What this stage built, and what the ring's shared prefixes built."""
        return self._counter[0] + self.ring.shared_built[0]

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
        step = max(1 << max(packed_bytes.bit_length() - 4, 0), ALIGN)
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
        """The copy groups of the pairs a subclass adds outside its roles."""
        return []
