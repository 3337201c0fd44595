"""``ForwardStaging``: the forward ring of the mirror path and what stages through it.

It owns the pinned slots a forward's shadow is written into, each with its device
stage, the ring's one shared device ``zone``, the fixed per-view stages of draft
depths and commit passes (``DepthStage``, ``CommitStage``), the per-shape shadow
route (``shadow``/``flush``) that the writers and oversized passes take, and the
ring's growth. ``MirrorBackend`` holds one and calls it by name: a plan step (``shadow``,
or a stage's ``args``: a slot and its numpy fields for the kernels) then a run step
(``flush``, or a stage's ``flush``: the H2D copy and the placement, device ops only).

Cost note: a staged forward costs 1 H2D copy of its shadow plus one ``CopyPlan``
(``copy_plan``): one ``_foreach_copy_`` for all its fields, 4- and 8-byte fields
alike read as int32 words, and one more ``copy_`` only where a dtype converts (an
int64 persistent table into an int32 view). A draft depth's shadow holds O(padded)
data (token maps, lengths, sums) and never a table: ``mha_block_table[:n]`` comes from
the persistent device ``block_table`` that ``begin_decode`` filled once per draft loop,
and its pad rows from ``minus_one``, both device-to-device in the same
``_foreach_copy_``. So a depth's host work and H2D bytes do not grow with ``W``.
Draft depths and commit passes stage through one fixed layout per view and kind
(``stages``: field offsets independent of the counts, kernel arguments built once per
slot, every slot's H2D landing in the zone, placement pairs from prefixes cached by
their own length, whatever the slot), so traffic whose counts change every step
builds no layout or plan. The writers, and a pass beyond the fixed capacities, take
the per-shape route.
The H2D copy is one contiguous byte range: copying strided pinned memory straight into
the view would make PyTorch stage each non-contiguous H2D copy through a temporary (an
allocation and a kernel); ``staging_slots`` (default 8) bounds how many staged calls
the host can run ahead of the device before ``acquire`` waits on a fence. A standard
step stages K draft depths and 1 commit pass through the forward ring, so 8 slots let
the host issue a whole step with K up to 7 without waiting on its own work
(``fence_stalls`` counts the waits that blocked).

Growth: a forward larger than a slot re-sizes the ring to at least twice its size
(geometric, so ever-growing forwards re-size O(log n) times), and the plans built on
the dropped ring are purged from every view that holds them.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.buffers.device_runtime import DeviceRuntime
from mtpmeta.buffers.grad_mode import kept_tensors
from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.gpu_view import ViewFields, ViewTarget, kernel_args, view_entries
from mtpmeta.mirror.commit_stage import CommitStage
from mtpmeta.mirror.copy_plan import CopyPlan, forward_pairs
from mtpmeta.mirror.depth_stage import DepthStage
from mtpmeta.mirror.pinned_ring import StagingRing
from mtpmeta.mirror.stages import ALIGN

__all__ = ["ForwardStaging"]

# Staging capacity is planned for 8-byte fields, the widest a view may use.
_WIDEST = ViewFields(**{name: torch.int64 for name in ViewFields._fields})
# Plan kinds built on one forward ring (their keys carry its generation at index 1).
_RING_PLANS = frozenset({"args", "h2d", "place", "depth", "commit"})


class ForwardStaging:
    """The forward ring: ``ring``, a ``StagingRing`` of ``num_slots`` pinned slots, each
    at least the view's shadow at capacity (``[max_requests, max_tokens, W]`` with
    8-byte fields), with a device twin per slot and one shared ``zone``;
    ``minus_one``, ``[R * W]`` int32 of -1 on the device (the pad table rows, placed
    device-to-device); ``reuse_table``, the begin's private ``[R, W]`` device table a
    commit pass places its reused leading rows from.

    Invariant: every plan a view caches over the ring (keys in ``_RING_PLANS``) carries
    the ``generation`` of the ring it was built on, and ``grow`` drops them all with
    the ring, so no plan ever reads a dropped ring. A slot is released (its fence
    recorded) only after the last op that reads it or its device stage was issued.
    """

    def __init__(self, buffers: PersistentBuffers, runtime: DeviceRuntime, *,
                 max_requests: int, max_tokens: int, num_slots: int,
                 reuse_table: Tensor, lifecycle: DeviceLifecycle) -> None:
        self.buffers = buffers
        self.runtime = runtime
        self.lifecycle = lifecycle
        self.device = buffers.offsets.device
        self.max_requests = max_requests
        self.reuse_table = reuse_table
        width = buffers.block_table.shape[1]
        capacity = PackedLayout.build(view_entries(max_requests, max_tokens, width, _WIDEST),
                                      align=ALIGN)
        self.ring = StagingRing(capacity.nbytes, num_slots, self.device, runtime,
                                device_twin=True)
        self.generation = 0  # bumped when the ring is re-sized
        self.retired_stalls = 0  # fence_stalls of replaced rings
        # [R * W] int32 of -1 on the device: the source of a draft depth's pad rows
        # of mha_block_table, so they are placed device-to-device with the rest.
        self.minus_one = torch.full((max_requests * width,), -1, dtype=torch.int32,
                                    device=self.device)
        self._planned: "weakref.WeakSet[ViewTarget]" = weakref.WeakSet()  # ring plans

    @property
    def fence_stalls(self) -> int:
        """Fence waits of this ring and the replaced ones that found a slot in use."""
        return self.retired_stalls + sum(fence.blocked for fence in self.ring.fences)

    def depth_stage(self, target: ViewTarget) -> Optional[DepthStage]:
        """The view's fixed draft-depth staging on the current ring (built on the first
        depth), or None when it does not fit a slot (the depth then takes the
        per-shape ``shadow``/``flush`` route)."""
        stage = target.plans.get(("depth", self.generation))
        if stage is None:
            stage = self._keep_stage(target, "depth", DepthStage.fitting(
                target, self.ring, self.buffers, self.minus_one, self.max_requests))
        return stage or None

    def commit_stage(self, target: ViewTarget) -> Optional[CommitStage]:
        """The view's fixed commit-pass staging on the current ring
        (``CommitStage.fitting``), or None. A pass beyond its capacities takes the
        per-shape ``shadow``/``flush`` route (which grows the ring; the next
        generation's stage then holds more)."""
        stage = target.plans.get(("commit", self.generation))
        if stage is None:
            stage = self._keep_stage(target, "commit", CommitStage.fitting(
                target, self.ring, self.buffers, self.max_requests, self.reuse_table))
        return stage or None

    def _keep_stage(self, target: ViewTarget, kind: str, stage: Any) -> Any:
        """Cache ``stage`` (False: "does not fit") on the view for this ring."""
        stage = stage or False
        target.plans.put((kind, self.generation), stage)
        self._planned.add(target)
        return stage

    def shadow(self, target: ViewTarget, tokens: int, requests: Optional[int],
               table_rows: Optional[int] = None
               ) -> Tuple[int, PackedLayout, tuple, tuple]:
        """Acquire a slot; return ``(slot, layout, token_args, request_args)``, the last
        two the slot's numpy fields in the kernels' argument order.

        ``tokens``/``requests`` are the extents the shadow holds (None: no request
        fields). ``table_rows`` is how many block-table rows it holds (default
        ``requests``, the whole table); a depth passes 0, so its shadow holds O(padded)
        data and no table at all, and a commit pass leaves out the rows it places from
        the device. Grows the ring first when the layout does not fit a slot.
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
            layout = PackedLayout.build(entries, align=ALIGN)
            plans.put(key, layout)
        if layout.nbytes > self.ring.slot_bytes:
            self.grow(layout.nbytes)
        slot = self.ring.acquire()
        args_key = ("args", self.generation, slot, layout)
        args = plans.get(args_key)
        if args is None:
            args = kernel_args(layout.arrays(self.ring.host_np[slot]))
            plans.put(args_key, args)
            self._planned.add(target)
        return slot, layout, args[0], args[1]

    def flush(self, target: ViewTarget, slot: int, layout: PackedLayout, tokens: int,
              real_tokens: int, requests: Optional[int], to_lengths: str,
              lengths_count: int, device_rows: int = 0, reused: bool = False) -> None:
        """Copy the slot's shadow into its device stage (one H2D copy), place it into
        the view with one ``CopyPlan`` (one ``_foreach_copy_`` per dtype group), then
        release the slot (its fence recorded after the last op that reads it).

        ``tokens``/``requests`` are the padded extents the shadow holds, ``real_tokens``
        the tokens whose request/position fields are written. ``to_lengths`` names what
        also lands in the persistent length buffers: ``"pair"`` (query and KV,
        ``lengths_count`` long), ``"query"`` (query only) or ``""``. ``mha_block_table``
        takes rows ``[:device_rows]`` device-to-device (from the persistent device
        ``block_table``, or with ``reused``, a commit pass, from ``reuse_table``), the
        shadow's table rows after them, and -1 rows from ``minus_one`` for the rest up
        to ``requests``. The plan is cached on the view.
        """
        plans = target.plans
        ring = self.ring
        generation = self.generation
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
                target.fields, staged, self.buffers, self.minus_one, tokens,
                real_tokens, requests, to_lengths, lengths_count, device_rows,
                self.reuse_table if reused else self.buffers.block_table))
            plans.put(key, plan)
        plan.run()
        ring.release(slot)

    def grow(self, nbytes: int) -> None:
        """Re-size the ring for a forward of ``nbytes`` larger than a slot.

        Only writers and commit passes can get here (a draft depth stages at most
        ``max_requests`` tokens), never the draft loop. The new size is at least twice
        the old one, so forwards that keep growing re-size O(log n) times. Waits on
        every slot's fence first (each recorded after the ops reading that slot and its
        device stage), so no pending op reads the buffers being dropped; plans built on
        them (keys carrying the old ``generation``) are purged from every view that
        holds some, so the old ring is freed.
        """
        ring = self.ring
        for fence in ring.fences:
            fence.wait()
        self.retired_stalls += sum(fence.blocked for fence in ring.fences)
        self.lifecycle.retire()  # the old ring's device stages and zone, used on any stream
        with kept_tensors():
            self.ring = StagingRing(max(nbytes, 2 * ring.slot_bytes), ring.num_slots,
                                    self.device, self.runtime, device_twin=True)
        self.lifecycle.born()  # the new ring's fills, before a writer on any stream
        self.generation += 1
        for target in list(self._planned):
            plans = target.plans
            for key in [key for key in plans
                        if isinstance(key, tuple) and key[0] in _RING_PLANS]:
                del plans[key]
        self._planned.clear()
