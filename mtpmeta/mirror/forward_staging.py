"""The mirror path's forward staging, ``ForwardStaging``: the half of ``MirrorBackend``
(``mirror.py``, the entry points) that stages a forward into the view: the forward
ring of pinned slots with their device stages, the fixed per-view stages of draft
depths and commit passes (``shadow_stage.py``), and the per-shape shadow route
(``_shadow``/``_flush``) that the writers and oversized passes take. A mixin: it
reads the backend's ``runtime``, ``device``, ``buffers``, ``max_requests`` and
``_reuse_table``.

Cost note: a staged forward costs 1 H2D copy of its shadow plus one ``CopyPlan``
(``placement.py``): one ``_foreach_copy_`` for all its fields, 4- and 8-byte fields
alike read as int32 words, and one more ``copy_`` only where a dtype converts (an
int64 persistent table into an int32 view). A draft depth's shadow holds O(padded)
data (token maps, lengths, sums) and never a table: ``mha_block_table[:n]`` comes from
the persistent device ``block_table`` that ``begin_decode`` filled once per draft loop,
and its pad rows from a persistent device block of -1, both device-to-device in the
same ``_foreach_copy_``. So a depth's host work and H2D bytes do not grow with ``W``.
Draft depths and commit passes stage through one fixed layout per view and kind
(``shadow_stage.py``: field offsets independent of the counts, kernel arguments built
once per slot, every slot's H2D landing in the ring's one device ``zone``, placement
pairs from prefixes cached by their own length, whatever the slot), so traffic
whose counts change every step builds no layout or plan; the same ops as a
``CopyPlan``, and the H2D copy also carries the unplaced tails of the fields before
the last one. The writers, and a pass beyond the fixed capacities, take the per-shape
route (``_shadow``/``_flush``).
The H2D copy is one contiguous byte range: copying strided pinned memory straight into
the view would make PyTorch stage each non-contiguous H2D copy through a temporary (an
allocation and a kernel); ``staging_slots`` (default 8) bounds how many staged calls
per ring the host can run ahead of the device before ``acquire`` waits on a fence. A
standard step stages K draft depths and 1 commit pass through the forward ring, so 8
slots let the host issue a whole step with K up to 7 without waiting on its own work
(``fence_stalls`` counts the waits that blocked).

Growth: a forward larger than the forward staging re-sizes it to at least twice its
size (geometric, so ever-growing forwards re-size O(log n) times), and the copy plans
built on the dropped ring are purged from every view that holds them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from mtpmeta.gpu_view import ViewFields, ViewTarget, kernel_args, view_entries
from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.mirror.copy_plan import CopyPlan, forward_pairs
from mtpmeta.mirror.stages import CommitStage, DepthStage
from mtpmeta.mirror.pinned_ring import StagingRing

__all__ = ["ForwardStaging"]

# Staging capacity is planned for 8-byte fields, the widest a view may use.
_WIDEST = ViewFields(**{name: torch.int64 for name in ViewFields._fields})
_ALIGN = 8
# Plan kinds built on one forward ring (their keys carry its generation at index 1).
_RING_PLANS = frozenset({"args", "h2d", "place", "depth", "commit"})


class ForwardStaging:
    """The forward ring and the shadow route of ``MirrorBackend`` (module docstring)."""

    def _init_forward_staging(self, max_requests: int, max_tokens: int, width: int,
                              num_slots: int) -> None:
        runtime = self.runtime
        # Forward staging: a shadow of the view per slot, planned for 8-byte fields at
        # capacity, each slot with its own device stage.
        capacity = PackedLayout.build(view_entries(max_requests, max_tokens, width, _WIDEST),
                                      align=_ALIGN)
        self._generation = 0  # bumped when the forward staging is re-sized
        self._retired_stalls = 0  # fence_stalls of replaced forward rings
        self._forward_ring = StagingRing(capacity.nbytes, num_slots, self.device, runtime,
                                         device_twin=True)
        # [R * W] int32 of -1 on the device: the source of a draft depth's pad rows
        # of mha_block_table, so they are placed device-to-device with the rest.
        self._minus_one = torch.full((max_requests * width,), -1, dtype=torch.int32,
                                     device=self.device)
        self._planned: "weakref.WeakSet[ViewTarget]" = weakref.WeakSet()  # ring plans

    def _grow(self, nbytes: int) -> None:
        """Re-size the forward staging for a forward larger than ``allocate`` planned.

        Only writers and commit passes can get here (a draft depth stages at most
        ``max_requests`` tokens), never the draft loop. The new size is at least twice
        the old one, so forwards that keep growing re-size O(log n) times. Waits on
        every slot's fence first (each recorded after the ops reading that slot and its
        device stage), so no pending op reads the buffers being dropped; plans built on
        them (keys carrying the old ``_generation``) are purged from every view that
        holds some, so the old ring is freed.
        """
        ring = self._forward_ring
        for fence in ring.fences:
            fence.wait()
        self._retired_stalls += sum(fence.blocked for fence in ring.fences)
        self.lifecycle.retire()  # the old ring's device stages and zone, used on any stream
        self._forward_ring = StagingRing(max(nbytes, 2 * ring.slot_bytes), ring.num_slots,
                                         self.device, self.runtime, device_twin=True)
        self.lifecycle.born()  # the new ring's fills, before a writer on any stream
        self._generation += 1
        for target in list(self._planned):
            plans = target.plans
            for key in [key for key in plans
                        if isinstance(key, tuple) and key[0] in _RING_PLANS]:
                del plans[key]
        self._planned.clear()

    def _shadow(self, target: ViewTarget, tokens: int, requests: Optional[int],
                table_rows: Optional[int] = None):
        """Acquire a forward slot; return ``(slot, layout, token_args, request_args)``,
        the last two the slot's numpy fields in the kernels' argument order.

        ``table_rows`` is how many block-table rows the shadow holds (default
        ``requests``, the whole table); a draft depth passes 0, so its shadow holds
        O(padded) data and no table at all, and a commit pass leaves out the rows it
        places from the persistent device table.
        """
        plans = target.plans
        key = ("layout", tokens, requests, table_rows)
        layout = plans.get(key)
        if layout is None:
            dtypes = ViewFields(*(tensor.dtype for tensor in target.fields))
            entries = view_entries(requests, tokens, target.width, dtypes)
            if table_rows is not None:
                entries = tuple((name, dtype, (table_rows, target.width))
                                if name == "mha_block_table" else (name, dtype, shape)
                                for name, dtype, shape in entries)
            layout = PackedLayout.build(entries, align=_ALIGN)
            plans.put(key, layout)
        if layout.nbytes > self._forward_ring.slot_bytes:
            self._grow(layout.nbytes)
        slot = self._forward_ring.acquire()
        args_key = ("args", self._generation, slot, layout)
        args = plans.get(args_key)
        if args is None:
            args = kernel_args(layout.arrays(self._forward_ring.host_np[slot]))
            plans.put(args_key, args)
            self._planned.add(target)
        return slot, layout, args[0], args[1]

    def _flush(self, target: ViewTarget, slot: int, layout: PackedLayout, tokens: int,
               real_tokens: int, requests: Optional[int], to_lengths: str,
               lengths_count: int, device_rows: int = 0, reused: bool = False) -> None:
        """Copy the slot's shadow into its device stage (one H2D copy), place it into
        the view with one ``CopyPlan`` (one ``_foreach_copy_`` per dtype group), then
        record the slot's fence (after the last op that reads the slot or its stage).

        ``tokens``/``requests`` are the padded extents the shadow holds, ``real_tokens``
        the tokens whose request/position fields are written. ``to_lengths`` names what
        also lands in the persistent length buffers: ``"pair"`` (query and KV,
        ``lengths_count`` long), ``"query"`` (query only) or ``""``. ``mha_block_table``
        takes rows ``[:device_rows]`` device-to-device (from the persistent device
        ``block_table``, or with ``reused``, a commit pass, from the private
        ``_reuse_table``), the shadow's table rows after them, and -1 rows from a
        persistent device block for the rest up to ``requests``: a draft depth's shadow
        holds no table (``device_rows = n``, -1 pad rows). The plan is cached on the view.
        """
        plans = target.plans
        ring = self._forward_ring
        generation = self._generation
        nbytes = layout.nbytes
        dst, src = plans.get_or_build(("h2d", generation, slot, nbytes), lambda: (
            ring.device_slots[slot][:nbytes], ring.slots[slot][:nbytes]))
        dst.copy_(src, non_blocking=True)
        key = ("place", generation, slot, layout, tokens, real_tokens, requests, to_lengths,
               lengths_count, device_rows, reused)
        plan = plans.get(key)
        if plan is None:
            staged = layout.tensors(ring.device_slots[slot])
            plan = CopyPlan(forward_pairs(
                target.fields, staged, self.buffers, self._minus_one, tokens,
                real_tokens, requests, to_lengths, lengths_count, device_rows,
                self._reuse_table if reused else self.buffers.block_table))
            plans.put(key, plan)
        plan.run()
        ring.release(slot)

    def _depth_stage(self, target: ViewTarget) -> Optional[DepthStage]:
        """The view's fixed draft-depth staging on the current forward ring (built on
        the first depth), or None when it does not fit a slot (the depth then takes
        the per-shape ``_shadow``/``_flush`` route)."""
        stage = target.plans.get(("depth", self._generation))
        if stage is None:
            stage = self._keep_stage(target, "depth", DepthStage.fitting(
                target, self._forward_ring, self.buffers, self._minus_one,
                self.max_requests))
        return stage or None

    def _keep_stage(self, target: ViewTarget, kind: str, stage):
        """Cache ``stage`` (False: "does not fit") on the view for this ring."""
        stage = stage or False
        target.plans.put((kind, self._generation), stage)
        self._planned.add(target)
        return stage

    def _commit_stage(self, target: ViewTarget) -> Optional[CommitStage]:
        """The view's fixed commit-pass staging on the current forward ring
        (``CommitStage.fitting``), or None. A pass beyond its capacities takes the
        per-shape ``_shadow``/``_flush`` route (which grows the ring; the next
        generation's stage then holds more)."""
        stage = target.plans.get(("commit", self._generation))
        if stage is None:
            stage = self._keep_stage(target, "commit", CommitStage.fitting(
                target, self._forward_ring, self.buffers, self.max_requests,
                self._reuse_table))
        return stage or None
