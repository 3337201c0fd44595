"""Buffers created, re-sized and dropped on one stream while another uses them.

Failure story: an engine runs the library on more than one stream (a copy stream beside
its compute stream, a resume on another stream after a suspend). Buffers born on stream
a are initialised by fill kernels queued there; a first use on stream b, with nothing
ordering it after those fills, reads (or gets overwritten by) them. Buffers dropped on
stream a while b still has work queued that reads them go back to the caching allocator,
which hands them to the next allocation at once. Every such moment goes through
``mtpmeta.buffers.lifecycle.DeviceLifecycle``; these scenarios run under the CUDA
simulator with the device lagging, and each fails with that rule switched off
(``lifecycle_off``, the negative control) or, for the carry, without its stream order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.buffers.device_runtime import StreamOrder
from mtpmeta.buffers.lifecycle import DeviceLifecycle
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from tests.cuda_sim import CudaSim, SimGraph
from tests.helpers import config
from tests.test_cuda_sim import (assert_snapshots_equal, host, new_pair, random_call,
                                 view_snapshot)
from tests.test_sim_hazards import upload

SEEDS = range(12)
PERSISTENT = ("offsets", "block_table", "query_lengths", "kv_lengths",
              "chunk_boundary_hidden")


@pytest.fixture(params=[False, True], ids=["rule", "lifecycle_off"])
def lifecycle_off(request, monkeypatch):
    """With ``True``, the negative control: ``born``/``retire`` do nothing, and every
    scenario below must then fail for at least one seed."""
    if request.param:
        monkeypatch.setattr(DeviceLifecycle, "_settle", lambda self: None)
    return request.param


def _expect(failures: int, off: bool) -> None:
    if off:
        assert failures > 0, "the scenario cannot tell the rule from no rule"
    else:
        assert failures == 0


def _matches(sim: CudaSim, snap: dict, want: dict) -> bool:
    got = {name: sim.peek(value) for name, value in snap.items()}
    try:
        assert_snapshots_equal([("view", got)], [("view", want)])
    except AssertionError:
        return False
    return True


def test_first_draft_loop_on_another_stream_sees_allocate_initialised_buffers(
        lifecycle_off):
    """allocate() on the default stream, then the first draft depth on stream b."""
    wrong = 0
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        sim = CudaSim(seed, idle=1.0)
        with sim:
            view = ContextGPUView(8, 64, 6)
            sim.synchronize()
            meta = MTPMetadata(**config())
            meta.allocate("cpu", mirror=True, max_tokens=64)  # fills queued on default
            with sim.bypass():
                ref = ReferenceMTPMetadata(**config())
                ref.allocate("cpu")
                ref_view = ReferenceGPUView(8, 64, 6, "cpu")
            starts = host(rng.integers(0, 20, size=8).astype(np.int32))
            table = host(rng.integers(0, 48, size=(8, 6)).astype(np.int32))
            with sim.stream(sim.Stream("b")):
                meta.begin_decode(5, 6, starts, table, False)
                meta.setup_decode_step(view)
                snap = dict(view_snapshot(view), block_table=meta.block_table.clone())
            with sim.bypass():
                ref.begin_decode(5, 6, starts, table, False)
                ref.setup_decode_step(ref_view)
                want = dict(view_snapshot(ref_view), block_table=ref.block_table.clone())
            sim.synchronize()
            wrong += not _matches(sim, snap, want)
    _expect(wrong, lifecycle_off)


def test_writer_on_another_stream_after_a_staging_resize_sees_its_own_values(
        lifecycle_off):
    """A writer on stream a re-sizes the forward staging (a forward past max_tokens);
    a writer on stream b then lands its copy in the new ring's device stages."""
    wrong = 0
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        sim = CudaSim(seed, idle=1.0)
        with sim:
            meta, ref, pairs = new_pair(sim, views=2, max_tokens=16, view_tokens=96)
            table = host(rng.integers(0, 48, size=(8, 6)).astype(np.int32))
            results = []
            for (view, ref_view), stream, count in zip(pairs, (sim.Stream("a"),
                                                               sim.Stream("b")), (60, 10)):
                rows = host(rng.integers(0, 8, size=count).astype(np.int32))
                positions = host(rng.integers(0, 24, size=count).astype(np.int32))
                with sim.stream(stream):
                    meta.write_token_maps(view, rows, positions, table, count + 3)
                    snap = view_snapshot(view)
                ref.write_token_maps(ref_view, rows, positions, table, count + 3)
                with sim.bypass():
                    results.append((snap, view_snapshot(ref_view)))
            sim.synchronize()
            wrong += sum(not _matches(sim, snap, want) for snap, want in results)
    _expect(wrong, lifecycle_off)


def _queue_a_step_on(sim: CudaSim, meta: MTPMetadata, view, stream, seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts = host(rng.integers(0, 20, size=8).astype(np.int32))
    table = host(rng.integers(0, 48, size=(8, 6)).astype(np.int32))
    with sim.stream(stream):
        meta.begin_decode(5, 6, starts, table, False)
        meta.setup_decode_step(view)
        meta.advance_decode_step()
        meta.end_forward()
        method, args, kwargs = random_call(rng, "commit")
        getattr(meta, method)(view, *args, **kwargs)
        meta.end_forward()


@pytest.mark.parametrize("drop", ["deallocate", "reallocate"])
def test_dropped_buffers_are_not_freed_under_work_queued_on_another_stream(
        lifecycle_off, drop):
    """A step queued on stream b, then deallocate (or a re-allocate) on the default
    stream, then the owner drops the old buffers: none may still be read by b's queue."""
    unsafe = 0
    for seed in SEEDS[:4]:
        sim = CudaSim(seed, idle=1.0)
        with sim:
            meta, _, [(view, _)] = new_pair(sim)
            _queue_a_step_on(sim, meta, view, sim.Stream("b"), seed)
            owned = [getattr(meta, name) for name in PERSISTENT]
            if drop == "deallocate":
                meta.deallocate()
            else:
                meta.allocate("cpu", mirror=True)
            for tensor in owned:
                sim.free(tensor)
            unsafe += len(sim.unsafe_frees)
            sim.synchronize()
    _expect(unsafe, lifecycle_off)


def _token_inputs(sim: CudaSim, rng: np.random.Generator) -> list:
    """Device rows, positions and an [8, 6] table for a 12-token ``write_token_maps``."""
    return [upload(sim, rng.integers(0, 8, size=12).astype(np.int32)),
            upload(sim, rng.integers(0, 24, size=12).astype(np.int32)),
            upload(sim, rng.integers(0, 48, size=(8, 6)).astype(np.int32))]


def _scratch_in_use_on_stream_b(sim: CudaSim, meta: MTPMetadata, view: ContextGPUView,
                                inputs: list) -> list:
    """A device-route ``write_token_maps`` makes ``view``'s scratch on the default
    stream, then a second write through it is queued on stream b; the scratch's
    storages (at least one)."""
    sim.synchronize()
    before = {storage._cdata for storage in sim._keep}
    meta.write_token_maps(view, *inputs, 16)  # the scratch is made here
    sim.synchronize()
    scratch = [storage for storage in sim._keep if storage._cdata not in before]
    with sim.stream(sim.Stream("b")):
        meta.write_token_maps(view, *inputs, 16)
    assert scratch
    return scratch


def _host_write(meta: MTPMetadata, view: ContextGPUView) -> None:
    """A two-token ``write_token_maps`` into ``view`` from host inputs (the forward
    staging: no scratch)."""
    meta.write_token_maps(view, host(np.zeros(2, np.int32)), host(np.zeros(2, np.int32)),
                          host(np.zeros((8, 6), np.int32)), 2)


def _unsafe_frees(sim: CudaSim, scratch: list) -> int:
    """Free the owner's last references to ``scratch``; the frees that came while
    queued work may still read it."""
    for storage in scratch:
        sim.free(torch.empty(0, dtype=torch.uint8).set_(storage))
    return len(sim.unsafe_frees)


def test_evicted_view_scratch_is_not_freed_under_work_queued_on_another_stream(
        lifecycle_off):
    """A device-route writer makes its view's scratch on the default stream, a second
    write through it is queued on stream b, then eight more views evict that view from
    the object's view cache, which drops the scratch while b may still use it."""
    unsafe = 0
    for seed in SEEDS[:4]:
        rng = np.random.default_rng(seed)
        sim = CudaSim(seed, idle=1.0)
        with sim:
            meta, _, [(view, _)] = new_pair(sim)
            inputs = _token_inputs(sim, rng)
            scratch = _scratch_in_use_on_stream_b(sim, meta, view, inputs)
            others = [ContextGPUView(8, 64, 6) for _ in range(8)]  # alive: distinct ids
            for other in others:  # host inputs: the forward staging, no scratch
                _host_write(meta, other)
            unsafe += _unsafe_frees(sim, scratch)  # the evicted target's scratch goes
            sim.synchronize()
    _expect(unsafe, lifecycle_off)


def test_take_on_another_stream_reads_the_carry_of_the_last_carry(monkeypatch):
    """carry_chunk_boundary on stream a, take_chunk_boundary and a read on stream b;
    with the take outside the stream order (the control) b reads the previous carry."""
    for control in (False, True):
        if control:
            monkeypatch.setattr(StreamOrder, "enter_unless_capturing", lambda self: None)
        stale = 0
        for seed in SEEDS:
            sim = CudaSim(seed, idle=1.0)
            with sim:
                meta, _, _ = new_pair(sim)
                hidden = host(np.full(8, seed + 1.0, dtype=np.float32))
                with sim.stream(sim.Stream("a")):
                    meta.carry_chunk_boundary(hidden, 3, 7)
                with sim.stream(sim.Stream("b")):
                    read = meta.take_chunk_boundary(3, 7).clone()
                sim.synchronize()
                got = sim.peek(read).flatten().tolist()
            stale += got != [seed + 1.0] * 8
        if control:
            assert stale > 0, "the scenario cannot tell an ordered take from none"
        else:
            assert stale == 0




def _rebind(holder: list) -> ContextGPUView:
    """A field assigned a new tensor: the view's next call resolves it again."""
    view = holder[0]
    view.token_to_pos_ids = view.token_to_pos_ids.clone()
    return view


def _replace_by_id(holder: list) -> ContextGPUView:
    """The view (``holder``'s only reference to it) dies and a new one takes its ``id``
    (CPython reuses the memory of a freed object for the next of its size); the
    objects made on the way stay alive in ``holder`` so they cannot take it."""
    key = id(holder.pop())
    for _ in range(100_000):
        new = object.__new__(ContextGPUView)  # only the object: nothing else allocated
        if id(new) == key:
            new.__init__(8, 64, 6)
            return new
        holder.append(new)
    pytest.fail("no new view reused the dead view's id")


@pytest.mark.parametrize("resolve_again", [_rebind, _replace_by_id],
                         ids=["field rebound", "id reused"])
def test_re_resolved_view_scratch_is_not_freed_under_work_queued_on_another_stream(
        lifecycle_off, resolve_again):
    """A device-route ``write_token_maps`` makes its view's token scratch on the default
    stream and queues a second write through it on stream b; then the view is resolved
    again (a field rebound, or a new view under the dead view's id), which drops the
    old target and its scratch while b may still use it."""
    unsafe = 0
    for seed in SEEDS[:4]:
        rng = np.random.default_rng(seed)
        sim = CudaSim(seed, idle=1.0)
        with sim:
            meta, _, [(view, _)] = new_pair(sim)
            inputs = _token_inputs(sim, rng)
            scratch = _scratch_in_use_on_stream_b(sim, meta, view, inputs)
            other = ContextGPUView(8, 64, 6)  # becomes last_forward's view instead
            _host_write(meta, other)
            holder = [view]
            del view
            again = resolve_again(holder)
            meta.write_token_maps(again, *inputs, 16)  # resolves it again
            unsafe += _unsafe_frees(sim, scratch)  # the replaced target's scratch goes
            sim.synchronize()
    _expect(unsafe, lifecycle_off)


def test_view_scratch_dropped_inside_a_capture_waits_for_the_next_sync_outside_it():
    """A captured draft depth resolves a view whose field was rebound while its old
    target holds device scratch: dropping that scratch may not synchronize inside the
    capture (CUDA refuses it), so the lifecycle keeps the old target until the next
    synchronize outside the capture, and the scratch is freed only after it."""
    rng = np.random.default_rng(5)
    sim = CudaSim(5, idle=1.0)
    with sim:
        meta, _, [(view, _)] = new_pair(sim)
        meta.write_token_maps(view, *_token_inputs(sim, rng), 16)  # token scratch
        lifecycle = meta._backend.lifecycle
        target = meta._target(view)
        scratch = target.token_scratch
        assert scratch is not None
        del target
        meta.begin_decode_for_capture(6, capture_setup=True)
        sim.synchronize()
        syncs = sim.syncs
        view.mha_block_table = view.mha_block_table.clone()  # rebound before the capture
        with sim.capture(SimGraph()):
            meta.setup_decode_step(view)  # resolves it again, in the capture
            meta.advance_decode_step()
        assert sim.syncs == syncs, sim.sync_reasons[syncs:]
        assert lifecycle.holding == 1
        meta.end_forward()
        meta.allocate("cpu", mirror=True)  # a synchronize outside a capture
        assert lifecycle.holding == 0
        sim.synchronize()
