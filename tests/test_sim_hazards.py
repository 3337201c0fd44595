"""The mirror path's device hazards under the CUDA-semantics simulator
(``tests/cuda_sim.py``).

Each section pins one hazard of the mirror path: device-route rows outside the table,
persistent buffers shared by two streams, caller device tensors freed while queued
work reads them, a capture on another stream, staging growth, and host stalls. The
two planted bugs at the end (a pageable ``begin_decode`` ring, a ``DeviceRoute`` that
raises) are negative controls: installed through the seams, they must fail the checks.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from typing import Any, List

import numpy as np
import pytest
import torch

import mtpmeta.mirror.backend as mirror_module
from mtpmeta import ContextGPUView, GraphCaptureError, MTPMetadata
from mtpmeta.bench.workload import make_steps, run_step
from tests.cuda_sim import DEVICE, PAGEABLE, CaptureSyncError, CudaSim, SimGraph
from tests.helpers import config
from tests.test_cuda_sim import (ForwardLog, assert_no_hidden_copies,  # noqa: F401
                                 assert_snapshots_equal, host, make_sim, new_pair, random_call, run_standard_steps,
                                 small_step_config, snapshot, view_snapshot)

pytestmark = [
    pytest.mark.cuda_sim,
    pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                       reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call"),
]

R, W, BS, D = 8, 6, 4, config()["dummy_block_idx"]


def upload(sim: CudaSim, array: Any, stream: Any = None) -> torch.Tensor:
    """A simulated device tensor holding ``array`` (a blocking upload: one sync), made
    on ``stream`` (default: the current one)."""
    values = torch.as_tensor(np.ascontiguousarray(array))
    with sim.stream(stream if stream is not None else sim.current_stream):
        out = torch.empty(values.shape, dtype=values.dtype)
        out.copy_(values)
    return out


# ------------------------------------------------- hazard 1: device-route rows
def test_device_route_rows_outside_the_table_go_to_dummy(device_route):
    """Row -1 must not wrap to the last row (another request's block), row R must not
    index past the table, and a row past a short ``inherited_blocks`` must not index
    past it: each token goes to D, with a request index inside the table."""
    kwargs = config()
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True)
    view = ContextGPUView(R, 16, W)
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    positions = torch.tensor([5, 5, 5, 9], dtype=torch.int32)  # columns 1, 1, 1, 2
    meta.write_token_maps(view, torch.tensor([-1, 0, R, 3], dtype=torch.int32), positions,
                          table, 4)
    assert view.token_to_block_idx[:4].tolist() == [D, int(table[0, 1]), D,
                                                    int(table[3, 2])]
    assert view.token_to_request_idx[:4].tolist() == [0, 0, R - 1, 3]
    assert view.token_to_local_position_within_kv_block[:4].tolist() == [1, 1, 1, 1]
    assert view.token_to_position_in_request[:4].tolist() == [5, 5, 5, 9]
    # inherited_blocks shorter than the rows: row 3 has no entry, row 1 has one.
    meta.write_token_maps(view, torch.tensor([3, 1], dtype=torch.int32),
                          torch.tensor([9, 9], dtype=torch.int32), table, 2,
                          inherited_blocks=torch.tensor([0, 1], dtype=torch.int32))
    assert view.token_to_block_idx[:2].tolist() == [D, int(table[1, 2])]
    assert view.token_to_request_idx[:2].tolist() == [1, 1]
    # No usable row at all (an empty inherited_blocks): every token to D, request 0.
    meta.write_token_maps(view, torch.tensor([0, 2], dtype=torch.int32),
                          torch.tensor([1, 9], dtype=torch.int32), table, 2,
                          inherited_blocks=torch.zeros(0, dtype=torch.int32))
    assert view.token_to_block_idx[:2].tolist() == [D, D]
    assert view.token_to_request_idx[:2].tolist() == [0, 0]


def test_device_route_bad_rows_under_the_simulator_fault_nothing_and_never_sync(make_sim):
    """The same rows as simulated device tensors: no device-side fault (CUDA: a lost
    context), no sync, and D for every bad row's token."""
    sim = make_sim(2)
    with sim:
        meta, _, [(view, _)] = new_pair(sim)
        table = upload(sim, np.arange(R * W, dtype=np.int32).reshape(R, W))
        rows = upload(sim, np.array([-1, R, 2, 5], dtype=np.int32))
        positions = upload(sim, np.array([5, 5, 5, 5], dtype=np.int32))
        inherited = upload(sim, np.array([0, 0, 0], dtype=np.int32))  # rows 0..2 only
        sim.synchronize()
        syncs = sim.syncs
        meta.write_token_maps(view, rows, positions, table, 4, inherited_blocks=inherited)
        assert sim.syncs == syncs, sim.sync_reasons[syncs:]
        sim.synchronize()
        assert sim.device_error is None
        blocks = sim.peek(view.token_to_block_idx[:4]).tolist()
        requests = sim.peek(view.token_to_request_idx[:4]).tolist()
    assert blocks == [D, D, 2 * W + 1, D]
    assert requests == [0, 2, 2, 2]
    assert_no_hidden_copies(sim)


# --------------------------------------- hazard 2: persistent buffers, two streams
PERSISTENT = ("offsets", "block_table", "query_lengths", "kv_lengths")


def alternate_streams(sim: CudaSim, seed: int, lanes: List[Any]):
    """Commit passes and draft depths issued on ``lanes`` in turn (one view each); for
    each call, the persistent buffers and the view as a forward on that lane reads
    them, and the reference's. Returns (label, got, want) triples, synchronised."""
    rng = np.random.default_rng(seed)
    checks = []
    with sim:
        meta, ref, pairs = new_pair(sim, views=2)
        for index in range(16):
            lane = index % 2
            view, ref_view = pairs[lane]
            if index % 4 < 2:
                method, args, kwargs = random_call(rng, "commit")
                calls = [(method, (view,) + args, (ref_view,) + args, kwargs)]
            else:
                starts = host(rng.integers(0, W * BS - 3, size=R).astype(np.int32))
                table = host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
                n = int(rng.integers(1, R + 1))
                calls = [("begin_decode", (n, n, starts, table, False),
                          (n, n, starts, table, False), {}),
                         ("setup_decode_step", (view,), (ref_view,), {})]
            with sim.stream(lanes[lane]):
                for method, args, ref_args, kwargs in calls:
                    getattr(meta, method)(*args, **kwargs)
                snap = {name: getattr(meta, name).clone() for name in PERSISTENT}
                snap.update(view_snapshot(view))
                meta.end_forward()
                event = sim.Event()
                event.record(lanes[lane])
            with sim.bypass():
                for method, args, ref_args, kwargs in calls:
                    getattr(ref, method)(*ref_args, **kwargs)
                want = {name: getattr(ref, name).clone() for name in PERSISTENT}
                want.update(view_snapshot(ref_view))
                ref.end_forward()
            checks.append((f"call {index} ({calls[-1][0]}, lane {lane})", event, snap, want))
        results = []
        for label, event, snap, want in checks:
            event.synchronize()
            results.append((label, {k: sim.peek(v) for k, v in snap.items()}, want))
        sim.synchronize()
    assert_no_hidden_copies(sim)
    return results


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_persistent_buffers_stay_right_when_passes_alternate_streams(make_sim, seed):
    """Two streams take turns at commit passes and draft depths: the query/KV lengths,
    offsets and block table a forward on each stream reads (not only its view) must be
    the reference's, whatever order the device runs the two streams in."""
    sim = make_sim(seed, idle=0.9)
    lanes = [sim.Stream("a"), sim.Stream("b")]
    failures = []
    for label, got, want in alternate_streams(sim, seed, lanes):
        try:
            assert_snapshots_equal([(label, got)], [(label, want)])
        except AssertionError as error:
            failures.append(f"{label}: {str(error)[:300]}")
    assert not failures, f"{len(failures)} wrong:\n" + "\n".join(failures[:3])


# ------------------------------------- hazard 3: caller tensors freed while queued
def test_sim_flags_freeing_a_tensor_another_stream_still_reads(make_sim):
    """The allocator model itself: a copy queued on stream b reads a tensor made on
    stream a; freeing it is flagged without record_stream, and not with it."""
    sim = make_sim(idle=1.0)
    with sim:
        a, b = sim.Stream("a"), sim.Stream("b")
        for record in (False, True):
            source = upload(sim, np.arange(4, dtype=np.int32), stream=a)
            target = torch.zeros(4, dtype=torch.int32)
            with sim.stream(b):
                target.copy_(source, non_blocking=True)
                if record:
                    sim.runtime.record_stream(source, torch.device("cpu"))
            before = len(sim.unsafe_frees)
            sim.free(source)
            assert (len(sim.unsafe_frees) > before) == (not record), sim.unsafe_frees
        sim.synchronize()


def test_device_hidden_and_device_inputs_from_another_stream_may_be_freed_at_once(make_sim):
    """The producer makes the carry's hidden and the device-route inputs on its own
    stream and frees them right after each call (CUDA: the caching allocator may reuse
    them for its next allocation on that stream). The queued copies must be covered
    by record_stream, and the values must still arrive."""
    sim = make_sim(5, idle=1.0)
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        producer = sim.Stream("producer")
        hidden_np = np.arange(8, dtype=np.float32)
        starts_np = np.array([3, 7, 11, 2, 0, 5, 9, 1], dtype=np.int32)
        table_np = np.arange(R * W, dtype=np.int32).reshape(R, W)
        hidden = upload(sim, hidden_np.reshape(1, 8), stream=producer)
        starts = upload(sim, starts_np, stream=producer)
        table = upload(sim, table_np, stream=producer)
        counts = upload(sim, np.array([3, 1, 2], dtype=np.int32), stream=producer)
        sim.synchronize()
        meta.carry_chunk_boundary(hidden, 3, 17)
        sim.free(hidden)
        meta.begin_decode(5, 6, starts, table, False)
        sim.free(starts)
        sim.free(table)
        meta.stage_prefill_lengths(counts, 2)
        sim.free(counts)
        assert sim.unsafe_frees == [], sim.unsafe_frees
        assert sim.record_streams >= 4
        sim.synchronize()
        ref.carry_chunk_boundary(host(hidden_np), 3, 17)
        ref.begin_decode(5, 6, host(starts_np), host(table_np), False)
        ref.stage_prefill_lengths(host(np.array([3, 1, 2], dtype=np.int32)), 2)
        got = snapshot(meta)
        with sim.bypass():
            want = snapshot(ref._obj)
        sim.synchronize()
    assert_snapshots_equal([("after", {k: sim.peek(v) for k, v in got.items()})],
                           [("", want)])


# ----------------------------------------- hazard 4: a capture on another stream
def test_setup_during_another_streams_capture_is_refused_and_leaves_it_valid(make_sim):
    """Another thread captures on its own stream (global mode) while this one stages on
    the default stream with every slot's fence still pending. A fence wait would query
    an event and invalidate that capture (cudaErrorStreamCaptureUnsupported); the call
    must be refused with GraphCaptureError instead, and the capture must survive."""
    rng = np.random.default_rng(8)
    sim = make_sim(1, idle=1.0)  # the device runs nothing: every fence stays pending
    with sim:
        meta, ref, [(view, _)] = new_pair(sim, slots=2)
        for _ in range(2):  # both slots used: the next acquire must wait on a fence
            method, args, kwargs = random_call(rng, "tokens")
            getattr(meta, method)(view, *args, **kwargs)
        graph = SimGraph()
        capture = sim.capture(graph, sim.Stream("other thread"))
        capture.__enter__()
        try:
            with sim.stream(sim.default_stream):
                method, args, kwargs = random_call(rng, "tokens")
                with pytest.raises(GraphCaptureError):
                    getattr(meta, method)(view, *args, **kwargs)
                assert not graph.invalidated, "a fence query invalidated the capture"
        finally:
            capture.__exit__(None, None, None)
        assert graph.items == []
        # Once the capture ends, the same call runs.
        getattr(meta, method)(view, *args, **kwargs)
        sim.synchronize()


def test_sim_refuses_capture_of_the_legacy_default_stream(make_sim):
    sim = make_sim()
    with sim:
        with pytest.raises(RuntimeError, match="legacy default stream"):
            with sim.capture(SimGraph(), sim.default_stream):
                pass


def test_sim_counts_work_on_other_streams_during_a_capture(make_sim):
    """Global-mode capture: work issued on another stream meanwhile is flagged."""
    sim = make_sim(idle=1.0)
    with sim:
        x = torch.zeros(4)
        with sim.capture(SimGraph()):
            x.add_(1)  # captured: not flagged
            with sim.stream(sim.default_stream):
                x.add_(2)  # uncaptured work during the capture
        assert sim.uncaptured_during_capture == 1
        sim.synchronize()


# -------------------------------------------------- hazard 5: staging growth
def test_staging_growth_is_geometric_and_frees_replaced_rings():
    """1,000 forwards, each one token longer than the last, from a staging planned for
    16 tokens: the forward staging re-sizes O(log n) times, no replaced ring stays
    referenced (by plans or anything else), and the plans cached on the view stay
    bounded. Exact values equal a plain mirror-path object planned for the largest."""
    kwargs = config()
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True, max_tokens=16)
    view = ContextGPUView(R, 1100, W)
    backend = meta._backend
    rng = np.random.default_rng(0)
    table = host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
    rings = [weakref.ref(backend.forward.ring)]
    for count in range(17, 1017):
        rows = host(rng.integers(0, R, size=count).astype(np.int32))
        positions = host(rng.integers(0, W * BS, size=count).astype(np.int32))
        meta.write_token_maps(view, rows, positions, table, count)
        if rings[-1]() is not backend.forward.ring:
            rings.append(weakref.ref(backend.forward.ring))
    gc.collect()
    assert len(rings) - 1 <= 8, f"{len(rings) - 1} re-sizes for 1,000 growing forwards"
    alive = [ring for ring in rings[:-1] if ring() is not None]
    assert not alive, f"{len(alive)} replaced rings still referenced"
    target = meta._memo.target(view)
    stale = [key for key in target.plans if isinstance(key, tuple) and key[0] == "args"
             and key[1] != backend.forward.generation]
    assert not stale, stale[:3]
    # The last forward's maps are exact.
    big = MTPMetadata(**kwargs)
    big.allocate("cpu", mirror=True, max_tokens=1100)
    big_view = ContextGPUView(R, 1100, W)
    big.write_token_maps(big_view, rows, positions, table, count)
    for name in ("token_to_block_idx", "token_to_request_idx", "token_to_pos_ids"):
        assert torch.equal(getattr(view, name)[:count], getattr(big_view, name)[:count])


# ------------------------------------------------------- hazard 6: host stalls
@pytest.mark.parametrize("depths", [1, 3, 7])
def test_a_standard_step_never_waits_on_its_own_work_with_default_slots(make_sim, depths):
    """With the default staging_slots and a device that runs nothing during the step,
    a standard step with up to 7 draft depths never blocks on a fence (its own work
    is all the ring holds): neither the simulator nor the library counts a stall."""
    cfg = dataclasses.replace(small_step_config(), depths=depths)
    inputs = make_steps(cfg, 3, depths)
    sim = make_sim(depths, idle=1.0)
    with sim:
        meta = MTPMetadata(**cfg.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=cfg.max_tokens)
        view = ContextGPUView(cfg.max_requests, cfg.max_tokens, cfg.block_columns)
        for step in inputs:
            sim.synchronize()  # the device caught up with every earlier step
            stalls = sim.stalls
            run_step(meta, view, step, cfg)
            assert sim.stalls == stalls, f"K={depths}: the step waited on its own work"
        sim.synchronize()
    assert meta._backend.fence_stalls == 0
    assert_no_hidden_copies(sim)


def test_fence_stalls_counts_every_wait_that_blocked(make_sim):
    """The library's counter agrees with the simulator's: with 2 slots and a stalled
    device, every forward after the second waits."""
    rng = np.random.default_rng(3)
    sim = make_sim(0, idle=1.0)
    with sim:
        meta, _, [(view, _)] = new_pair(sim, slots=2)
        for _ in range(6):
            method, args, kwargs = random_call(rng, "tokens")
            getattr(meta, method)(view, *args, **kwargs)
        sim.synchronize()
    assert sim.stalls == 4
    assert meta._backend.fence_stalls == 4


@pytest.mark.parametrize("seed", range(3, 7))
def test_back_to_back_prefill_lengths_each_reach_their_own_forward(make_sim, seed):
    """stage_prefill_lengths 12 times back to back with 2 staging slots, on a device
    that lags far behind the host; each call is followed by a forward reading
    ``query_lengths`` on the stream (a clone). Every forward reads its own lengths: a
    lengths slot is never rewritten while its copy is pending (its fence is recorded,
    and acquire waits on it, as the stalls show)."""
    sim = make_sim(seed, idle=0.97)
    want, kept = [], []
    with sim:
        meta = MTPMetadata(**config())
        meta.allocate("cpu", mirror=True, max_tokens=64, staging_slots=2)
        sim.synchronize()
        for i in range(12):
            requests, pad = 2 + i % 3, i % 2
            counts = np.full(requests, i + 1, np.int32)
            kept.append(meta.stage_prefill_lengths(host(counts), pad).clone())
            want.append(counts.tolist() + ([pad] if pad else []))
        sim.synchronize()
        got = [sim.peek(t).tolist() for t in kept]
    assert got == want
    assert meta._backend.fence_stalls > 0


# ------------------------------------- the device-input route under the simulator
def device_input_steps(sim: CudaSim, seed: int = 0):
    """Every device-route call (begin_decode, draft depths, stage_prefill_lengths,
    write_token_maps, write_mha_metadata, the carry) with simulated device inputs, and
    the reference with the same values on the host: both forward logs."""
    rng = np.random.default_rng(seed)
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        log, ref_log = ForwardLog(meta), ForwardLog(ref)
        for round_ in range(3):
            calls = []
            n = int(rng.integers(1, R + 1))
            starts = rng.integers(0, W * BS - 4, size=R).astype(np.int32)
            table = rng.integers(0, R * W, size=(R, W)).astype(np.int32)
            calls.append(("begin_decode", (n, R, starts, table, False), False))
            calls += [("setup_decode_step", (), True), ("advance_decode_step", (), False)] * 3
            calls.append(("end_forward", (), False))
            counts = rng.integers(1, 4, size=int(rng.integers(1, R))).astype(np.int32)
            calls.append(("stage_prefill_lengths", (counts, 2), False))
            count = int(rng.integers(1, 20))
            rows = rng.integers(0, R, size=count).astype(np.int32)
            positions = rng.integers(0, W * BS, size=count).astype(np.int32)
            calls.append(("write_token_maps", (rows, positions, table, count + 2), True))
            q = rng.integers(0, 5, size=n).astype(np.int32)
            kv = rng.integers(0, 30, size=n).astype(np.int32)
            calls.append(("write_mha_metadata", (q, kv, table[:n], n), True))
            hidden = rng.standard_normal(8).astype(np.float32)
            calls.append(("carry_chunk_boundary", (hidden, 3, 17 + round_), False))
            for method, args, takes_view in calls:
                device_args = tuple(upload(sim, a) if isinstance(a, np.ndarray) else a
                                    for a in args)
                host_args = tuple(host(a) if isinstance(a, np.ndarray) else a
                                  for a in args)
                sim.synchronize()  # the uploads are the scheduler's, not measured
                syncs = sim.syncs
                getattr(log, method)(*(((view,) if takes_view else ()) + device_args))
                assert sim.syncs == syncs, f"{method}: {sim.sync_reasons[syncs:]}"
                with sim.bypass():
                    getattr(ref_log, method)(*(((ref_view,) if takes_view else ())
                                               + host_args))
            meta.end_forward()
            ref.end_forward()
        sim.synchronize()
    assert_no_hidden_copies(sim)
    return log.snapshots, ref_log.snapshots


def test_device_inputs_take_the_device_route_and_match_the_reference(make_sim):
    """Simulated device inputs reach ``device_route.DeviceRoute`` (routed by the
    runtime, not ``tensor.is_cpu``), run with no sync, no hidden copy and no scan that
    allocates on CUDA, and every forward equals the reference's."""
    sim = make_sim(4)
    calls = []
    original = mirror_module.DeviceRoute

    class Counting(original):  # counts without changing behaviour
        def __getattribute__(self, name):
            if not name.startswith("_") and name not in ("buffers", "runtime", "device",
                                                          "width", "block_size", "dummy"):
                calls.append(name)
            return super().__getattribute__(name)

    mirror_module.DeviceRoute = Counting
    try:
        ours, theirs = device_input_steps(sim)
    finally:
        mirror_module.DeviceRoute = original
    assert_snapshots_equal(ours, theirs)
    assert sim.scan_workspaces == 0, sim.scan_log
    assert sim.staged_searches == 0, sim.search_log
    assert {"begin_decode", "decode_step", "stage_prefill_lengths", "write_token_maps",
            "write_mha_metadata"} <= set(calls), sorted(set(calls))


# ------------------------------------------------------- planted bugs (controls)
class RaisingDeviceRoute:
    """Planted bug 2: every method raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"planted: DeviceRoute.{name}")
        return fail


def test_planted_raising_device_route_fails_the_device_input_check(make_sim, monkeypatch):
    monkeypatch.setattr(mirror_module, "DeviceRoute", RaisingDeviceRoute)
    with pytest.raises(RuntimeError, match="planted"):
        device_input_steps(make_sim(4))


def test_planted_pageable_begin_ring_fails_the_standard_step_check(make_sim):
    """Planted bug 1: the begin_decode ring built over pageable memory. The standard
    steps still compute the same values, so only the pageable-copy count catches it,
    and run_standard_steps must assert on it."""
    sim = make_sim(0)
    made = []
    real = sim.runtime.host_empty

    def host_empty(shape, dtype):
        made.append(tuple(shape))
        if len(made) == 2:  # buffers' annotations first, then the begin ring
            with sim.bypass():
                return torch.empty(tuple(shape), dtype=dtype)
        return real(shape, dtype)

    sim.runtime.host_empty = host_empty
    with pytest.raises(AssertionError, match="pageable"):
        run_standard_steps(sim, 0, steps=3)
    assert sim.pageable_async_copies > 0


def test_planted_begin_ring_is_the_one_made_pageable(make_sim):
    """The plant above hits the begin ring (so the control tests what it says)."""
    sim = make_sim(0)
    real = sim.runtime.host_empty
    made = []

    def host_empty(shape, dtype):
        made.append(tuple(shape))
        if len(made) == 2:
            with sim.bypass():
                return torch.empty(tuple(shape), dtype=dtype)
        return real(shape, dtype)

    sim.runtime.host_empty = host_empty
    with sim:
        meta = MTPMetadata(**config())
        meta.allocate("cpu", mirror=True)
        backend = meta._backend
        assert sim.kind(backend.begin.ring.host) == PAGEABLE
        assert sim.kind(backend.forward.ring.device_slots) == DEVICE
        assert sim.kind(backend.prefill_lengths.ring.host) != PAGEABLE


def test_a_per_stream_capture_check_lets_a_fence_query_invalidate_another_capture(make_sim):
    """The documented limit of ``TorchRuntime.is_capturing`` (it sees only this
    thread's current stream): with a runtime that, like it, checks only the current
    stream, the same call as above reaches a fence query and invalidates the other
    stream's global-mode capture. Servers that stage while another thread captures
    must capture with ``capture_error_mode="thread_local"``."""
    rng = np.random.default_rng(8)
    sim = make_sim(1, idle=1.0)
    sim.runtime.is_capturing = lambda device: sim.current_stream.capture is not None
    with sim:
        meta, _, [(view, _)] = new_pair(sim, slots=2)
        for _ in range(2):
            method, args, kwargs = random_call(rng, "tokens")
            getattr(meta, method)(view, *args, **kwargs)
        graph = SimGraph()
        capture = sim.capture(graph, sim.Stream("other thread"))
        capture.__enter__()
        with sim.stream(sim.default_stream):
            method, args, kwargs = random_call(rng, "tokens")
            with pytest.raises(CaptureSyncError):
                getattr(meta, method)(view, *args, **kwargs)
        with pytest.raises(CaptureSyncError, match="invalidated"):
            capture.__exit__(None, None, None)
        assert graph.invalidated
        sim.synchronize()


def test_sim_flags_strided_and_converting_h2d_copies(make_sim):
    """On CUDA these go through a pageable .contiguous() temporary and a device
    empty_like (a hidden sync and an allocation); a plain contiguous one does not."""
    sim = make_sim(idle=1.0)
    with sim:
        pinned = sim.host_empty((4, 4), torch.int32)
        pinned.zero_()
        target = torch.zeros((4, 4), dtype=torch.int32)
        target.copy_(pinned, non_blocking=True)
        assert sim.staged_h2d_copies == 0
        target.copy_(pinned.t(), non_blocking=True)  # strided source
        target64 = torch.zeros((4, 4), dtype=torch.int64)
        target64.copy_(pinned, non_blocking=True)  # dtype conversion
        target.copy_(pinned[:1], non_blocking=True)  # broadcast
        sim.synchronize()
    assert sim.staged_h2d_copies == 3, sim.staged_log


def test_sim_flags_scans_that_take_a_workspace_on_cuda(make_sim):
    """A whole-tensor (1-D) scan is a cub scan with allocator-backed temporary storage; a
    strided input or output, or a converting scan, is staged through a new tensor; a
    row scan of a contiguous ``[rows > 1, L]`` tensor into a contiguous output of its
    dtype takes none (ATen's ``scan_dim``)."""
    sim = make_sim(idle=1.0)
    with sim:
        rows = torch.ones((3, 5), dtype=torch.int32)
        out = torch.zeros((3, 5), dtype=torch.int32)
        torch.cumsum(rows, 1, dtype=torch.int32, out=out)
        assert sim.scan_workspaces == 0, sim.scan_log
        wide = torch.zeros((3, 7), dtype=torch.int32)
        torch.cumsum(rows[0], 0, dtype=torch.int32, out=out[0])  # 1-D: cub
        torch.cumsum(rows, 1, dtype=torch.int32, out=wide[:, :5])  # strided output
        torch.cumsum(wide[:, :5], 1, dtype=torch.int32, out=out)  # strided input
        torch.cumsum(rows, 1, dtype=torch.int64)  # converting
        sim.synchronize()
    assert sim.scan_workspaces == 4, sim.scan_log


def test_sim_flags_searches_that_stage_an_operand_on_cuda(make_sim):
    """A bucketize or searchsorted over contiguous operands of one dtype into a
    contiguous output stages nothing; a strided input, bounds or output, or an input of
    another dtype than the bounds, is copied into a new tensor first."""
    sim = make_sim(idle=1.0)
    with sim:
        bounds = torch.arange(5, dtype=torch.int64) * 4
        values = torch.arange(-6, 24, dtype=torch.int64).view(3, 10)
        out = torch.zeros((3, 10), dtype=torch.int64)
        torch.bucketize(values, bounds, right=True, out=out)
        torch.searchsorted(bounds, values, right=True, out=out)
        assert sim.staged_searches == 0, sim.search_log
        wide = torch.zeros((3, 12), dtype=torch.int64)
        torch.bucketize(values[:, :8], bounds, right=True, out=out[:, :8])  # input
        torch.bucketize(values, bounds[::2], right=True, out=out)  # bounds
        torch.bucketize(values, bounds, right=True, out=wide[:, :10])  # output
        torch.bucketize(values.to(torch.int32), bounds, right=True, out=out)  # dtypes
        sim.synchronize()
    assert sim.staged_searches == 4, sim.search_log


def test_sim_flags_foreach_copies_that_cuda_runs_pair_by_pair(make_sim):
    """CUDA fuses a ``_foreach_copy_`` into multi-tensor launches only when every tensor
    has one dtype and is dense and each pair shares sizes and strides; a word-viewed
    list of contiguous prefixes and dense 2-D rows passes, each kind of miss counts."""
    sim = make_sim(idle=1.0)
    with sim:
        a32, b32 = torch.zeros(12, dtype=torch.int32), torch.ones(12, dtype=torch.int32)
        rows = torch.ones((4, 6), dtype=torch.int32)
        wide = torch.zeros((4, 8), dtype=torch.int32)
        torch._foreach_copy_([a32[:5], wide[:2]], [b32[3:8], torch.ones((2, 8),
                                                                       dtype=torch.int32)])
        assert sim.unfused_foreach_copies == 0, sim.foreach_log
        torch._foreach_copy_([a32[:3], torch.zeros(3, dtype=torch.int64)],
                             [b32[:3], torch.ones(3, dtype=torch.int64)])  # two dtypes
        torch._foreach_copy_([wide[:, :6]], [rows])  # a strided destination
        torch._foreach_copy_([a32[::2]], [b32[:6]])  # a strided 1-D destination
        torch._foreach_copy_([wide.t().contiguous()], [wide.t()])  # both dense, unlike
        sim.synchronize()
    assert sim.unfused_foreach_copies == 4, sim.foreach_log


def test_draft_loops_scan_their_sums_without_a_workspace(make_sim):
    """Every cumulative sum of a draft loop is a row scan, which allocates nothing on
    CUDA: the device-input loop (its planned depths and two past the plan) and the
    captured route's depths run eagerly. A 1-D ``cumsum`` there (a cub scan, whose
    temporary storage comes from the caching allocator at every call) would be an
    allocation inside the draft loop. Each depth's view equals the reference's."""
    from mtpmeta.buffers.persistent import PLANNED_DEPTHS

    rng = np.random.default_rng(5)
    sim = make_sim(6)
    depths = PLANNED_DEPTHS + 2
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        starts = rng.integers(0, W * BS - depths, size=R).astype(np.int32)
        table = rng.integers(0, R * W, size=(R, W)).astype(np.int32)
        for n, padded, capture_setup in ((5, R, False), (R, R, False), (3, 6, True)):
            device_starts, device_table = upload(sim, starts), upload(sim, table)
            sim.synchronize()
            before = sim.scan_workspaces
            args = (device_starts, device_table) if not capture_setup else \
                (host(starts), host(table))
            meta.begin_decode(n, padded, *args, True, capture_setup=capture_setup)
            ref.begin_decode(n, padded, host(starts), host(table), True)
            for _ in range(depths if not capture_setup else 2):
                meta.setup_decode_step(view)
                ref.setup_decode_step(ref_view)
                sim.synchronize()
                for name in ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths",
                             "mha_query_lengths", "mha_kv_seq_lengths", "mha_block_table",
                             "token_to_block_idx", "token_to_pos_ids"):
                    got = sim.peek(getattr(view, name))[:padded + 1]
                    want = sim.peek(getattr(ref_view, name))[:padded + 1]
                    if capture_setup and name not in ("mha_cu_query_seq_lengths",
                                                      "mha_cu_kv_seq_lengths"):
                        got, want = got[:n], want[:n]  # pad rows: contract §12's values
                    assert torch.equal(got, want.to(got.dtype)), (name, got, want)
                meta.advance_decode_step()
                ref.advance_decode_step()
            meta.end_forward()
            ref.end_forward()
            assert sim.scan_workspaces == before, sim.scan_log[before:]
        sim.synchronize()
    assert sim.staged_searches == 0, sim.search_log  # the plan's bucketize: none


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_device_mha_writers_on_two_streams_keep_each_views_values(make_sim, seed):
    """View writers are not stream-ordered (they touch only the caller's view): two
    views written by device-route ``write_mha_metadata`` on two streams, each stream's
    inputs its own, must each get their own lengths and sums, whatever order the device
    runs the streams in (a scratch shared by the writers would let one stream's staged
    lengths reach the other's view)."""
    rng = np.random.default_rng(seed)
    sim = make_sim(seed, idle=0.9)
    lanes = [sim.Stream("a"), sim.Stream("b")]
    with sim:
        meta, ref, pairs = new_pair(sim, views=2)
        for _ in range(6):
            inputs = []
            for lane, (view, ref_view) in zip(lanes, pairs):
                n = int(rng.integers(1, R + 1))
                q = rng.integers(0, 5, size=n).astype(np.int32)
                kv = rng.integers(0, 30, size=n).astype(np.int32)
                table = rng.integers(0, R * W, size=(n, W)).astype(np.int32)
                device_args = [upload(sim, a, lane) for a in (q, kv, table)]
                inputs.append((lane, view, ref_view, device_args, (q, kv, table), n))
            sim.synchronize()  # the uploads are the scheduler's
            for lane, view, _, device_args, _, n in inputs:
                with sim.stream(lane):
                    meta.write_mha_metadata(view, *device_args, n)
            sim.synchronize()
            for _, view, ref_view, _, host_args, n in inputs:
                with sim.bypass():
                    ref.write_mha_metadata(ref_view, *(host(a) for a in host_args), n)
                for name in ("mha_query_lengths", "mha_kv_seq_lengths",
                             "mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths"):
                    got = sim.peek(getattr(view, name))[:n + 1]
                    want = sim.peek(getattr(ref_view, name))[:n + 1]
                    assert torch.equal(got, want.to(got.dtype)), (name, got, want)
    assert_no_hidden_copies(sim)
