"""The mirror path under CUDA semantics, simulated on the CPU (``tests/cuda_sim.py``).

The simulator queues device work on streams and lets a seeded "device" run behind the
host, reads pinned memory when a queued copy executes, and records ops under graph
capture. The library reaches it only through ``mtpmeta.buffers.device_runtime.use_runtime``. A
"forward" here is a device copy of the destination view (and of the draft buffers)
queued right after each view-writing call: what the model's kernels would read then.

Negative control: with ``MTPMETA_TEST_DISABLE_FENCES=1`` the fixture hands the library
no-op fences, and the pinned-slot race stress must fail (checked in a subprocess by
``test_negative_control_fences_off_fails_the_race_stress_in_a_subprocess``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch

from mtpmeta import VIEW_FIELDS, ContextGPUView, MTPMetadata, errors
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.bench.workload import StepConfig, make_steps, run_step
from tests.cuda_sim import (DEVICE, PAGEABLE, PINNED, RUNTIME_SYNC, CaptureSyncError, CudaSim,
                            SimDeviceError, SimGraph)
from tests.helpers import config

pytestmark = [
    pytest.mark.cuda_sim,
    # The debug checker reads device buffers through the runtime's blocking to_host, a
    # synchronize after every call, which hides the orderings these tests exercise.
    pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                       reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call"),
]

FENCES_OFF_VARIABLE = "MTPMETA_TEST_DISABLE_FENCES"
FIELDS = tuple(f.name for f in VIEW_FIELDS)
BUFFERS = ("offsets", "block_table", "query_lengths", "kv_lengths", "chunk_boundary_hidden")
# The library's capture refusal; a stand-in that nothing raises while it does not exist.
GraphCaptureError = getattr(errors, "GraphCaptureError", None)
_REFUSAL = GraphCaptureError or type("MissingGraphCaptureError", (Exception,), {})
_NO_REFUSAL_TYPE = "mtpmeta.errors.GraphCaptureError does not exist"


@pytest.fixture
def make_sim() -> Callable[..., CudaSim]:
    """Builds simulators; the only reader of MTPMETA_TEST_DISABLE_FENCES."""
    disable = os.environ.get(FENCES_OFF_VARIABLE) == "1"

    def build(seed: int = 0, **kwargs: Any) -> CudaSim:
        return CudaSim(seed, disable_fences=disable, **kwargs)

    return build


# ---------------------------------------------------------------------- helpers
def snapshot(meta: Any, view: Any = None) -> Dict[str, torch.Tensor]:
    """Copies of the view's fields and the draft buffers. Inside the simulator each is
    a device op queued on the current stream (a forward reading them now)."""
    snap = {name: getattr(meta, name).clone() for name in BUFFERS}
    snap["request_matched_prefix_blocks"] = meta.request_matched_prefix_blocks.clone()
    if view is not None:
        for name in FIELDS:
            snap[name] = getattr(view, name).clone()
    return snap


def view_snapshot(view: Any) -> Dict[str, torch.Tensor]:
    return {name: getattr(view, name).clone() for name in FIELDS}


class ForwardLog:
    """Wraps a library or reference object: after every state-changing call, a snapshot
    (the forward that would run next). Everything else passes through."""

    LOGGED = frozenset({"begin_decode", "advance_decode_step", "setup_decode_step",
                        "setup_commit_pass", "stage_prefill_lengths", "write_token_maps",
                        "write_mha_metadata", "carry_chunk_boundary", "move_request_rows",
                        "swap_request_rows", "reset_request_rows"})

    def __init__(self, meta: Any) -> None:
        self.meta = meta
        self.snapshots: List[Tuple[str, Dict[str, torch.Tensor]]] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.meta, name)
        if name not in self.LOGGED:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            view = args[0] if args and hasattr(args[0], "token_to_block_idx") else None
            self.snapshots.append((name, snapshot(self.meta, view)))
            return result

        return call


def assert_no_hidden_copies(sim: CudaSim) -> None:
    """No async copy from pageable memory, no strided/converting H2D copy and no
    ``_foreach_copy_`` that CUDA runs pair by pair so far."""
    assert sim.pageable_async_copies == 0, sim.pageable_log
    assert sim.staged_h2d_copies == 0, sim.staged_log
    assert sim.unfused_foreach_copies == 0, sim.foreach_log


def assert_snapshots_equal(ours: List[Tuple[str, Dict[str, torch.Tensor]]],
                           theirs: List[Tuple[str, Dict[str, torch.Tensor]]]) -> None:
    assert len(ours) == len(theirs)
    for index, ((call, mine), (_, ref)) in enumerate(zip(ours, theirs)):
        for key, value in mine.items():
            expected = ref[key].to(value.dtype).reshape(value.shape)
            assert torch.equal(value, expected), (
                f"forward {index} (after {call}): {key} differs\nsim {value}\nref {expected}")


def small_step_config() -> StepConfig:
    return StepConfig(max_requests=16, block_columns=8, block_size=4, active=10, depths=3,
                      prefill_tokens=12, inherited_blocks=2, tp=4, moves=2, swaps=1,
                      resets=2, hidden_size=8)


def run_standard_steps(sim: CudaSim, seed: int, steps: int, slots: int = 4):
    """The standard step under the simulator and plainly on the reference; returns both
    forward logs (the simulator's already synchronised)."""
    cfg = small_step_config()
    inputs = make_steps(cfg, steps, seed)
    ref = ReferenceMTPMetadata(**cfg.metadata_kwargs())
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(cfg.max_requests, cfg.max_tokens, cfg.block_columns, "cpu")
    ref_log = ForwardLog(ref)
    for step in inputs:
        run_step(ref_log, ref_view, step, cfg)
    with sim:
        meta = MTPMetadata(**cfg.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=cfg.max_tokens, staging_slots=slots)
        view = ContextGPUView(cfg.max_requests, cfg.max_tokens, cfg.block_columns)
        log = ForwardLog(meta)
        for step in inputs:
            run_step(log, view, step, cfg)
        sim.synchronize()
    # No async copy from pageable memory (on CUDA: a hidden sync, or a read of memory
    # the caller may reuse) and no strided/converting H2D copy (a hidden temporary).
    assert_no_hidden_copies(sim)
    return log.snapshots, ref_log.snapshots


def new_pair(sim: CudaSim, *, views: int = 1, max_tokens: int = 16384, slots: int = 4,
             view_tokens: int = 64):
    """A mirror-path object allocated under ``sim`` (call inside ``with sim``), its
    reference, and ``views`` (device view, reference view) pairs; the device is drained."""
    kwargs = config()
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True, max_tokens=max_tokens, staging_slots=slots)
    ref = ReferenceMTPMetadata(**kwargs)
    R, W = kwargs["max_requests"], kwargs["max_kv_block_count"]
    views_here = [ContextGPUView(R, view_tokens, W) for _ in range(views)]
    with sim.bypass():
        ref.allocate("cpu")
        pairs = [(v, ReferenceGPUView(R, view_tokens, W, "cpu")) for v in views_here]
    sim.synchronize()
    return meta, Bypassed(ref, sim), pairs


class Bypassed:
    """The reference inside ``with sim``: its method calls run plainly on the host."""

    def __init__(self, obj: Any, sim: CudaSim) -> None:
        self._obj = obj
        self._sim = sim

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._obj, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._sim.bypass():
                return attribute(*args, **kwargs)

        return call


def host(array: np.ndarray) -> torch.Tensor:
    """A pageable host tensor (torch.from_numpy is no aten op: the simulator leaves it
    on the host)."""
    return torch.from_numpy(np.ascontiguousarray(array))


def random_call(rng: np.random.Generator, kind: str, max_tokens: int = 24):
    """(method name, args after the view, kwargs) of a valid host-input forward on the
    ``config()`` geometry: R=8, W=6, BS=4."""
    R, W, BS = 8, 6, 4
    span = W * BS
    table = host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
    if kind == "tokens":
        count = int(rng.integers(1, max_tokens))
        rows = host(rng.integers(0, R, size=count).astype(np.int32))
        positions = host(rng.integers(0, span, size=count).astype(np.int32))
        padded = count + int(rng.integers(0, 4))
        return "write_token_maps", (rows, positions, table, padded), {}
    if kind == "mha":
        count = int(rng.integers(1, R))
        q = host(rng.integers(0, 5, size=count).astype(np.int32))
        kv = host(rng.integers(0, 30, size=count).astype(np.int32))
        padded = min(R, count + int(rng.integers(0, 3)))
        return "write_mha_metadata", (q, kv, table[:count], padded), {}
    if kind == "commit":
        count = int(rng.integers(1, R))
        starts = rng.integers(0, span - 4, size=count).astype(np.int32)
        counts = rng.integers(1, 5, size=count).astype(np.int32)
        total = int(counts.sum())
        return "setup_commit_pass", (host(counts), table), dict(
            start_positions=host(starts), padded_token_count=total + int(rng.integers(0, 3)))
    raise ValueError(kind)


def forward_reading_view(view: Any, padded: int) -> torch.Tensor:
    """The captured "model forward": gathers what attention reads for ``padded`` rows."""
    parts = [view.token_to_block_idx[:padded], view.token_to_local_position_within_kv_block[
        :padded], view.mha_query_lengths[:padded], view.mha_kv_seq_lengths[:padded],
        view.mha_cu_query_seq_lengths[:padded + 1], view.mha_cu_kv_seq_lengths[:padded + 1],
        view.mha_block_table[:padded].reshape(-1)]
    return torch.cat([p.long() for p in parts])


# ------------------------------------------------------------ harness self-tests
def test_sim_queued_device_op_is_invisible_until_a_sync(make_sim):
    """A device op issued by the host has not happened until the device gets to it; a
    sim whose queued ops ran at once would hide every ordering bug."""
    sim = make_sim(idle=1.0)  # the device never runs on its own
    with sim:
        x = torch.zeros(4)
        x.add_(1)
        assert sim.pending() == 2  # the zero fill and the add
        assert sim.peek(x).tolist() != [1.0] * 4
        assert float(x.sum()) == 4.0  # the host needs a value: drains first
        assert sim.syncs == 1 and sim.pending() == 0
        y = x * 2  # a functional device op: its output exists, its value does not yet
        assert sim.kind(y) == DEVICE and sim.pending() == 1
        sim.synchronize()
        assert sim.peek(y).tolist() == [2.0] * 4


def test_sim_sorts_memory_into_pinned_device_and_pageable(make_sim):
    """The pageable-copy hazard counter and the pinned read-at-execution rule depend on
    knowing where each storage lives."""
    before = torch.ones(3)
    sim = make_sim()
    with sim:
        pinned = sim.runtime.host_empty((4,), torch.int32)
        device = torch.zeros(4, dtype=torch.int32)
        host_result = before + 1
        from_numpy = host(np.arange(3))
        device_result = device + 1
        view = device[1:]
        assert sim.kind(before) == PAGEABLE and sim.kind(host_result) == PAGEABLE
        assert sim.kind(from_numpy) == PAGEABLE
        assert sim.kind(pinned) == PINNED and sim.kind(pinned[1:].view(torch.uint8)) == PINNED
        assert sim.kind(device) == DEVICE and sim.kind(view) == DEVICE
        assert sim.kind(device_result) == DEVICE


def test_sim_pinned_copy_reads_its_source_when_it_executes(make_sim):
    """An async copy from pinned memory reads the slot when the device runs it, so a
    host that rewrites the slot too early corrupts the copy (the race fences prevent).
    A blocking copy is a sync; an async copy from pageable memory is counted."""
    sim = make_sim(idle=1.0)
    with sim:
        pinned = sim.runtime.host_empty((4,), torch.int32)
        device = torch.zeros(4, dtype=torch.int32)
        pinned.numpy()[:] = 1
        device.copy_(pinned, non_blocking=True)
        pinned.numpy()[:] = 2  # the host reuses the slot before the copy ran
        sim.synchronize()
        assert sim.peek(device).tolist() == [2, 2, 2, 2]
        syncs = sim.syncs
        pinned.numpy()[:] = 3
        device.copy_(pinned)  # blocking: done when it returns
        pinned.numpy()[:] = 4
        assert sim.syncs == syncs + 1 and sim.peek(device).tolist() == [3, 3, 3, 3]
        assert sim.pageable_async_copies == 0
        device.copy_(host(np.arange(4, dtype=np.int32)), non_blocking=True)
        assert sim.pageable_async_copies == 1


def test_sim_event_query_and_synchronize_follow_the_queue(make_sim):
    """query() is True only once all work before record() ran; synchronize() runs up to
    the event and no further (fence waits must not be device-wide syncs)."""
    sim = make_sim(idle=1.0)
    with sim:
        x = torch.zeros(2)
        sim.synchronize()
        x.add_(1)
        event = sim.Event()
        event.record()
        x.add_(10)
        assert event.query() is False
        event.synchronize()
        assert event.query() is True and sim.stalls == 1
        assert sim.peek(x).tolist() == [1.0, 1.0] and sim.pending() == 1
        never = sim.Event()
        assert never.query() is True  # CUDA: an unrecorded event is complete
        sim.synchronize()
        assert sim.peek(x).tolist() == [11.0, 11.0]


def test_sim_capture_records_and_replay_reissues_with_current_values(make_sim):
    """Captured ops do not run; a replay re-runs them on whatever their tensors hold
    then (a pinned source included); a sync inside a capture raises as on CUDA."""
    sim = make_sim()
    with sim:
        pinned = sim.runtime.host_empty((3,), torch.int64)
        pinned.numpy()[:] = 5
        out = torch.zeros(3, dtype=torch.int64)
        sim.synchronize()
        graph = SimGraph()
        with sim.capture(graph):
            assert sim.runtime.is_capturing(torch.device("cpu"))
            out.copy_(pinned, non_blocking=True)
            out.mul_(2)
        assert not sim.runtime.is_capturing(torch.device("cpu"))
        sim.synchronize()
        assert sim.peek(out).tolist() == [0, 0, 0] and graph.pinned_reads == 1
        graph.replay()
        sim.synchronize()
        assert sim.peek(out).tolist() == [10, 10, 10]
        pinned.numpy()[:] = 7
        graph.replay()
        sim.synchronize()
        assert sim.peek(out).tolist() == [14, 14, 14]
        with pytest.raises(CaptureSyncError, match="not permitted when stream is capturing"):
            with sim.capture(SimGraph()):
                out.sum().item()
        event = sim.Event()
        with sim.capture(SimGraph()):
            event.record()
        with pytest.raises(RuntimeError, match="cudaErrorCapturedEvent"):
            event.query()


def test_sim_moves_version_counters_once_at_issue_as_cuda_does(make_sim):
    """An in-place op bumps its tensor's version counter when the host issues it, and
    never again when it executes (from a sync, or inside another op's tick); a factory
    op's queued fill bumps none, and a replay bumps none. A counter-based guard sees
    under the simulator what it sees on CUDA."""
    sim = make_sim(0, idle=1.0)  # the device never runs on its own
    with sim:
        x = torch.zeros(4, dtype=torch.int32)
        sim.synchronize()
        assert x._version == 0 and sim.peek(x).tolist() == [0] * 4
        x.add_(1)
        assert x._version == 1 and sim.pending() == 1
        sim.synchronize()
        assert x._version == 1 and sim.peek(x).tolist() == [1] * 4
        graph = SimGraph()
        with sim.capture(graph):
            x.add_(1)
        assert x._version == 2  # issued into the capture
        for _ in range(2):
            graph.replay()
            sim.synchronize()
        assert x._version == 2 and sim.peek(x).tolist() == [3] * 4
    sim = make_sim(0, idle=0.0, burst=0.0)  # the device runs 1-2 ops after every op
    with sim:
        x, other = torch.zeros(4, dtype=torch.int32), torch.zeros(4)
        sim.synchronize()
        x.add_(1)
        for _ in range(5):
            other.add_(1)  # x's op executes inside these ops' ticks
        assert sim.peek(x).tolist() == [1] * 4 and x._version == 1


def test_sim_two_streams_interleave_and_wait_event_orders_them(make_sim):
    """Two streams run in a random interleaving unless an event orders them: the
    two-stream hazard tests are only as good as this."""
    overtakes = 0
    for seed in range(20):
        sim = make_sim(seed, idle=1.0)  # all queued: the drain interleaves
        with sim:
            first, second = sim.Stream(), sim.Stream()
            x = torch.zeros(1)
            sim.synchronize()
            with sim.stream(first):
                for _ in range(3):
                    x.add_(1)
            with sim.stream(second):
                x.mul_(10)  # no ordering: may run before some of first's adds
            sim.synchronize()
            overtakes += sim.peek(x).item() != 30.0
            done = sim.Event()
            with sim.stream(first):
                x.fill_(0)
                x.add_(1)
                done.record()
            with sim.stream(second):
                second.wait_event(done)
                x.mul_(10)
            sim.synchronize()
            assert sim.peek(x).item() == 10.0
    assert 0 < overtakes < 20


def test_sim_device_fault_is_sticky_at_the_next_sync(make_sim):
    """An out-of-range gather queued on the device fails when it executes and every later
    sync reports it (CUDA's device-side assert), not where it was issued."""
    sim = make_sim(idle=1.0)
    with sim:
        table = torch.zeros((2, 3), dtype=torch.int64)
        columns = torch.full((2, 1), 7, dtype=torch.int64)
        torch.gather(table, 1, columns)  # issued fine: nothing ran yet
        with pytest.raises(SimDeviceError, match="device-side fault"):
            sim.synchronize()
        with pytest.raises(SimDeviceError):
            sim.synchronize()


def test_sim_data_dependent_shape_is_a_sync(make_sim):
    """nonzero's output size needs the data: the host waits for the device."""
    sim = make_sim(idle=1.0)
    with sim:
        x = torch.zeros(4)
        x[1:3] = 1
        indices = torch.nonzero(x)
        assert sim.syncs == 1 and indices.flatten().tolist() == [1, 2]


# --------------------------------------------------- the mirror path, standard step
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mirror_standard_steps_under_device_lag_match_reference(make_sim, seed):
    """With the device lagging (random, seeded), every forward of the standard step
    still sees exactly what the reference computes: no staged value is read late,
    early or from a reused slot. The host really ran ahead of the device."""
    sim = make_sim(seed)
    ours, theirs = run_standard_steps(sim, seed, steps=8)
    assert_snapshots_equal(ours, theirs)
    # The whole ring (4 slots) was in flight at once and the host got far ahead.
    assert sim.max_inflight_events >= 4
    assert sim.max_pending > 4 * 8, sim.max_pending
    # allocate's (its buffers born before any stream uses them) and the test's final one
    assert sim.sync_reasons == [RUNTIME_SYNC, "synchronize"]


def test_pinned_slot_reuse_race_stress(make_sim):
    """Two staging slots and a device that runs far behind: every reuse of a slot must
    wait for the copy still reading it, or an earlier forward sees a later forward's
    data. With no-op fences (MTPMETA_TEST_DISABLE_FENCES=1) this test must fail."""
    sim = make_sim(7, idle=0.92, burst=0.3, burst_max=24)
    ours, theirs = run_standard_steps(sim, 7, steps=6, slots=2)
    assert_snapshots_equal(ours, theirs)
    assert sim.stalls > 0  # the fences really held the host back


def test_no_op_fences_let_the_race_stress_corrupt_forwards():
    """The negative control, in process: the same stress with the fences removed does
    see corrupted forwards (so the stress can fail at all)."""
    sim = CudaSim(7, idle=0.92, burst=0.3, burst_max=24, disable_fences=True)
    ours, theirs = run_standard_steps(sim, 7, steps=6, slots=2)
    with pytest.raises(AssertionError, match="differs"):
        assert_snapshots_equal(ours, theirs)


def test_negative_control_fences_off_fails_the_race_stress_in_a_subprocess():
    """``pytest -m cuda_sim`` with MTPMETA_TEST_DISABLE_FENCES=1 fails (the stress
    catches the race), and the very same command without the variable passes."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
               "cuda_sim", "-k", "pinned_slot_reuse_race_stress", str(Path(__file__))]
    base = {k: v for k, v in os.environ.items()  # no inherited coverage or addopts
            if k not in (FENCES_OFF_VARIABLE, "PYTEST_ADDOPTS") and not k.startswith("COV_CORE")}
    runs = {}
    for label, env in (("fences off", dict(base, **{FENCES_OFF_VARIABLE: "1"})),
                       ("fences on", base)):
        runs[label] = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    results = {}
    for label, process in runs.items():
        output = process.communicate(timeout=300)[0]
        results[label] = (process.returncode, output)
    off_code, off_out = results["fences off"]
    on_code, on_out = results["fences on"]
    assert on_code == 0, f"the stress fails even with fences:\n{on_out[-3000:]}"
    # It fails on corrupted forward data, not on a bookkeeping assertion.
    assert off_code == 1 and "1 failed" in off_out and "differs" in off_out, (
        f"no-op fences did not make the stress fail:\n{off_out[-3000:]}")


# ------------------------------------------------------------- hazard 3: replay
@pytest.mark.parametrize("seed", [0, 1])
def test_graphed_replay_with_fewer_real_requests_sends_pad_rows_to_dummy(make_sim, seed):
    """A forward captured at padded P replays after an eager graphed setup with n < P
    real requests: pad rows must read the dummy block and zero lengths, never a stale
    row's real block (that would write real KV), and equal the eager reference."""
    kwargs = config()
    R, W, BS, D = (kwargs[k] for k in ("max_requests", "max_kv_block_count",
                                       "block_size_tokens", "dummy_block_idx"))
    P = 6
    rng = np.random.default_rng(seed)
    sim = make_sim(seed)
    rounds = []
    for n in (P, 3, 1, 0, P - 1, 2):
        starts = rng.integers(0, W * BS - 3, size=R).astype(np.int32)
        table = rng.integers(0, R * W, size=(R, W)).astype(np.int32)
        rounds.append((n, host(starts), host(table)))
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        meta.begin_decode_for_capture(P)
        meta.setup_decode_step(view)  # eager warm-up, as before a real capture
        graph = SimGraph()
        with sim.capture(graph):
            out = forward_reading_view(view, P)
        meta.end_forward()
        replays = []
        for n, starts, table in rounds:
            meta.begin_decode(n, P, starts, table, True)
            for _ in range(2):
                meta.setup_decode_step(view)
                graph.replay()
                replays.append(out.clone())
                meta.advance_decode_step()
            meta.end_forward()
        sim.synchronize()
        assert_no_hidden_copies(sim)
    expected = []
    for n, starts, table in rounds:
        ref.begin_decode(n, P, starts, table, True)
        for _ in range(2):
            ref.setup_decode_step(ref_view)
            expected.append((n, forward_reading_view(ref_view, P)))
            ref.advance_decode_step()
        ref.end_forward()
    for index, (got, (n, want)) in enumerate(zip(replays, expected)):
        assert got[n:P].tolist() == [D] * (P - n), (
            f"replay {index}: pad rows [{n}, {P}) point at {got[n:P].tolist()}, not {D}")
        assert torch.equal(got, want), f"replay {index} (n={n}):\nsim {got}\nref {want}"


def _capture_setup(meta, ref, view, ref_view, name: str, rng):
    """(state before, the call to make under capture, the same call on the reference)."""
    R, W, BS = 8, 6, 4
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    table = host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
    if name in ("setup_decode_step_graphed", "setup_decode_step_eager", "advance_decode_step"):
        graphed = name != "setup_decode_step_eager"
        for obj in (meta, ref):
            obj.begin_decode(5, 6, starts, table, graphed)
        method = "advance_decode_step" if name == "advance_decode_step" else "setup_decode_step"
        args = () if method == "advance_decode_step" else (view,)
        ref_args = () if method == "advance_decode_step" else (ref_view,)
        return method, args, ref_args, {}
    if name == "begin_decode":
        args = (5, 6, starts, table, True)
        return name, args, args, {}
    if name == "stage_prefill_lengths":
        args = (host(np.array([3, 1, 2], dtype=np.int32)), 2)
        return name, args, args, {}
    if name == "carry_chunk_boundary":
        args = (host(np.arange(8, dtype=np.float32)), 3, 17)
        return name, args, args, {}
    method, args, kwargs = random_call(rng, {"setup_commit_pass": "commit",
                                             "write_token_maps": "tokens",
                                             "write_mha_metadata": "mha"}[name])
    return method, (view,) + args, (ref_view,) + args, kwargs


CAPTURE_REFUSED = ["setup_decode_step_graphed", "setup_decode_step_eager", "begin_decode",
                   "advance_decode_step", "stage_prefill_lengths", "setup_commit_pass",
                   "write_token_maps", "write_mha_metadata", "carry_chunk_boundary"]


@pytest.mark.parametrize("name", CAPTURE_REFUSED)
def test_setup_calls_refuse_to_run_while_capturing_and_change_nothing(make_sim, name):
    """A setup call inside a CUDA-graph capture would bake this step's count, pinned
    slot and host decisions into the graph (replays then write stale rows or real KV).
    It must raise GraphCaptureError before doing anything: nothing recorded, no state
    changed, and the eager calls after it still match the reference."""
    rng = np.random.default_rng(CAPTURE_REFUSED.index(name))
    sim = make_sim(3)
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        for kind in ("tokens", "commit", "mha", "tokens"):  # warm the rings up
            method, args, kwargs = random_call(rng, kind)
            getattr(meta, method)(view, *args, **kwargs)
            getattr(ref, method)(ref_view, *args, **kwargs)
            meta.end_forward()
            ref.end_forward()
        method, args, _, kwargs = _capture_setup(meta, ref, view, ref_view, name, rng)
        sim.synchronize()
        before = (snapshot(meta, view), meta.forward_mode, meta.active_request_count,
                  meta.padded_count, meta.chunk_boundary_valid)
        graph = SimGraph()
        with pytest.raises(_REFUSAL):
            with sim.capture(graph):
                getattr(meta, method)(*args, **kwargs)
        assert GraphCaptureError is not None, _NO_REFUSAL_TYPE
        assert issubclass(GraphCaptureError, RuntimeError)
        assert graph.items == [], f"the refused call recorded {len(graph.items)} device ops"
        assert sim.captured_event_records == 0
        assert sim.uncaptured_during_capture == 0, "the refused call issued work elsewhere"
        after = (snapshot(meta, view), meta.forward_mode, meta.active_request_count,
                 meta.padded_count, meta.chunk_boundary_valid)
        assert before[1:] == after[1:]
        # Host truth did not move either: the eager continuation matches the reference.
        log, ref_log = ForwardLog(meta), ForwardLog(ref)
        if meta.forward_mode.name == "DRAFT":
            log.setup_decode_step(view)
            ref_log.setup_decode_step(ref_view)
            log.advance_decode_step()
            ref_log.advance_decode_step()
        sim.synchronize()
        assert_no_hidden_copies(sim)
    assert_snapshots_equal([("refused call", after[0])], [("before it", before[0])])
    assert_snapshots_equal(log.snapshots, ref_log.snapshots)


# ------------------------------------------------- hazard 4: host offsets stay true
def test_host_offsets_stay_true_across_replays(make_sim):
    """advance_decode_step is refused under capture (a captured advance moves only the
    device offsets, so every later eager depth would report a too-small max_seqlen_k
    and validate stale positions). With eager advances between replays, each depth's
    ForwardShape, its validation at the table's end and the device offsets all match
    the reference."""
    kwargs = config()
    R, W, BS = kwargs["max_requests"], kwargs["max_kv_block_count"], kwargs["block_size_tokens"]
    P, n = 6, 4
    rng = np.random.default_rng(5)
    starts = rng.integers(0, W * BS - 6, size=R).astype(np.int32)
    starts[2] = W * BS - 3  # row 2 drafts into the table's last slot, then past it
    starts, table = host(starts), host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
    sim = make_sim(11)
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        meta.begin_decode_for_capture(P)
        meta.setup_decode_step(view)
        graph = SimGraph()
        with sim.capture(graph):
            out = forward_reading_view(view, P)
        meta.end_forward()
        meta.begin_decode(n, P, starts, table, True)
        ref.begin_decode(n, P, starts, table, True)
        with pytest.raises(_REFUSAL):
            with sim.capture(SimGraph()):
                meta.advance_decode_step()
        assert GraphCaptureError is not None, _NO_REFUSAL_TYPE
        replays, expected, offsets = [], [], []
        for depth in range(4):
            outcomes = []
            for obj, v in ((meta, view), (ref, ref_view)):
                try:
                    outcomes.append(obj.setup_decode_step(v))
                except (ValueError, IndexError) as error:
                    outcomes.append(type(error))
            shape, ref_shape = outcomes
            assert (shape in (ValueError, IndexError)) == (ref_shape in (ValueError,
                                                                        IndexError)), (
                f"depth {depth}: library {shape} vs reference {ref_shape}")
            if isinstance(ref_shape, type):
                break
            assert shape == ref_shape, f"depth {depth}: {shape} vs {ref_shape}"
            graph.replay()
            replays.append(out.clone())
            expected.append(forward_reading_view(ref_view, P))
            meta.advance_decode_step()
            ref.advance_decode_step()
            offsets.append(meta.offsets.clone())
        sim.synchronize()
        assert_no_hidden_copies(sim)
    assert depth == 3, "the depth past the table's end was not refused"
    for index, (got, want) in enumerate(zip(replays, expected)):
        assert torch.equal(got, want), f"replay {index}:\nsim {got}\nref {want}"
    assert torch.equal(offsets[-1], ref.offsets)


# ---------------------------------------------------------- hazard 5: two streams
def test_two_streams_never_corrupt_each_others_staged_forwards(make_sim):
    """Forwards issued alternately on two streams (one view each) share the staging:
    each forward's view, read after that stream's event, must be exactly the
    reference's, whatever order the device ran the two streams' copies in."""
    failures = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        sim = make_sim(seed, idle=0.9)
        with sim:
            meta, ref, pairs = new_pair(sim, views=2)
            streams = [sim.Stream(), sim.Stream()]
            checks = []
            for index in range(24):
                lane = index % 2
                view, ref_view = pairs[lane]
                method, args, kwargs = random_call(rng, ("tokens", "commit", "mha")[index % 3])
                with sim.stream(streams[lane]):
                    getattr(meta, method)(view, *args, **kwargs)
                    meta.end_forward()
                    snap = view_snapshot(view)
                    event = sim.Event()
                    event.record(streams[lane])
                with sim.bypass():
                    getattr(ref, method)(ref_view, *args, **kwargs)
                    ref.end_forward()
                    checks.append((index, method, event, snap, view_snapshot(ref_view)))
            for index, method, event, snap, want in checks:
                event.synchronize()
                got = {k: sim.peek(v) for k, v in snap.items()}
                try:
                    assert_snapshots_equal([(method, got)], [(method, want)])
                except AssertionError as error:
                    failures.append(f"seed {seed}, forward {index}: {error}")
            sim.synchronize()
            assert_no_hidden_copies(sim)
    assert not failures, "\n".join(failures[:3])


def test_staging_regrow_while_copies_are_queued_is_safe(make_sim):
    """A write_token_maps larger than allocate's max_tokens re-sizes the staging while
    forwards on both streams still have copies queued: no queued copy may read the
    new staging, and no later forward the old one."""
    rng = np.random.default_rng(4)
    sim = make_sim(4, idle=0.95)
    with sim:
        meta, ref, pairs = new_pair(sim, views=2, max_tokens=16, view_tokens=96)
        streams = [sim.Stream(), sim.Stream()]
        checks = []
        for index in range(12):
            lane = index % 2
            view, ref_view = pairs[lane]
            big = index in (5, 9)
            method, args, kwargs = random_call(rng, "tokens", max_tokens=90 if big else 12)
            if big:
                count = 40 + 20 * (index == 9)
                args = (host(rng.integers(0, 8, size=count).astype(np.int32)),
                        host(rng.integers(0, 24, size=count).astype(np.int32)), args[2],
                        count + 3)
            with sim.stream(streams[lane]):
                getattr(meta, method)(view, *args, **kwargs)
                snap = view_snapshot(view)
                event = sim.Event()
                event.record(streams[lane])
            with sim.bypass():
                getattr(ref, method)(ref_view, *args, **kwargs)
                checks.append((index, event, snap, view_snapshot(ref_view)))
        for index, event, snap, want in checks:
            event.synchronize()
            got = {k: sim.peek(v) for k, v in snap.items()}
            assert_snapshots_equal([(f"forward {index}", got)], [("", want)])
            assert_no_hidden_copies(sim)


# -------------------------------------------- hazard 9: ring reuse under capture
RING_USERS = ["write_token_maps", "write_mha_metadata", "setup_commit_pass",
              "stage_prefill_lengths", "begin_decode", "setup_decode_step_eager"]


@pytest.mark.parametrize("name", RING_USERS)
def test_ring_using_calls_are_refused_under_capture_and_leave_no_pinned_read(make_sim, name):
    """A capture of a call that stages through a pinned slot would replay a copy from
    that slot long after the host reused it, and a fence recorded inside the capture
    makes the slot's next wait fail (cudaErrorCapturedEvent). The call must be refused
    with GraphCaptureError, leaving no pinned read in the graph and the ring usable."""
    rng = np.random.default_rng(RING_USERS.index(name) + 50)
    sim = make_sim(9)
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)  # fresh rings: first lap
        method, args, _, kwargs = _capture_setup(meta, ref, view, ref_view, name, rng)
        graph = SimGraph()
        refused = False
        try:
            with sim.capture(graph):
                getattr(meta, method)(*args, **kwargs)
        except _REFUSAL:
            refused = True
        assert graph.pinned_reads == 0, (
            f"the capture recorded {graph.pinned_reads} copies from pinned staging slots")
        assert sim.captured_event_records == 0, "a staging fence was recorded in the capture"
        assert sim.uncaptured_during_capture == 0, "the refused call issued work elsewhere"
        assert GraphCaptureError is not None, _NO_REFUSAL_TYPE
        assert refused, f"{method} ran under capture instead of raising GraphCaptureError"
        meta.end_forward()
        ref.end_forward()
        log, ref_log = ForwardLog(meta), ForwardLog(ref)
        for kind in ("tokens", "commit", "mha", "tokens", "commit", "mha"):  # every slot
            method, args, kwargs = random_call(rng, kind)
            getattr(log, method)(view, *args, **kwargs)
            with sim.bypass():
                getattr(ref_log, method)(ref_view, *args, **kwargs)
        sim.synchronize()
        assert_no_hidden_copies(sim)
    assert_snapshots_equal(log.snapshots, ref_log.snapshots)


# ------------------------------------------------------ hazard 10: carried hidden
def test_carry_from_a_pageable_host_hidden_is_never_an_async_pageable_copy(make_sim):
    """carry_chunk_boundary with a plain (pageable) host tensor: an async copy from
    pageable memory reads the caller's tensor whenever the device gets to it (or, on
    real CUDA, hides a stream sync). The caller may overwrite its tensor right after
    the call; the carried value must still be the one passed."""
    hidden = torch.randn(8)
    passed = hidden.clone()
    sim = make_sim(idle=1.0)
    with sim:
        meta, _, _ = new_pair(sim, views=0)
        syncs = sim.syncs
        meta.carry_chunk_boundary(hidden, 3, 17)
        hidden.fill_(123.0)  # the caller reuses its buffer at once
        carried = meta.take_chunk_boundary(3, 17).clone()  # the next chunk's forward
        assert sim.syncs == syncs, "the carry synchronised with the device"
        sim.synchronize()
    assert sim.pageable_async_copies == 0, sim.pageable_log
    assert torch.equal(carried.flatten(), passed)


def test_carry_from_a_device_hidden_is_ordered_before_later_writes(make_sim):
    """A device hidden: a write the caller queues after the call cannot reach the
    carried value, and the carry itself makes no sync. (The library tells host from
    device through the runtime, so the simulated device hidden takes the device copy.)"""
    values = torch.randn(8)
    sim = make_sim(idle=1.0)
    with sim:
        meta, _, _ = new_pair(sim, views=0)
        hidden = torch.zeros((1, 8))
        hidden.copy_(values.view(1, 8))  # a blocking upload, before the measured part
        syncs = sim.syncs
        meta.carry_chunk_boundary(hidden, 4, 9)
        assert sim.syncs == syncs, sim.sync_reasons[syncs:]
        assert sim.record_streams == 1  # the caller's tensor is covered for the copy
        hidden.fill_(-1.0)
        carried = meta.take_chunk_boundary(4, 9).clone()
        sim.synchronize()
    assert sim.pageable_async_copies == 0, sim.pageable_log
    assert torch.equal(carried.flatten(), values)


# ------------------------------------------------ hazard 11: how far the host runs
def stage_ahead(make_sim, slots: int, forwards: int, seed: int = 0, **lag: Any):
    """Forwards of one token-map write each; the stall count after each one."""
    rng = np.random.default_rng(seed)
    sim = make_sim(seed, **lag)
    with sim:
        meta, _, [(view, _)] = new_pair(sim, slots=slots)
        stalls = []
        for _ in range(forwards):
            method, args, kwargs = random_call(rng, "tokens")
            getattr(meta, method)(view, *args, **kwargs)
            stalls.append(sim.stalls)
        sim.synchronize()
        assert_no_hidden_copies(sim)
    return stalls, sim


@pytest.mark.parametrize("slots", [2, 4, 8])
def test_staging_slots_bound_how_far_the_host_runs_ahead(make_sim, slots, record_property):
    """With the device stalled, the host stages exactly ``staging_slots`` forwards
    ahead before a fence wait blocks it (no stall while fewer are in flight, a stall
    on the next one). Also measured: stalls per 100 forwards against a lagging device."""
    stalls, _ = stage_ahead(make_sim, slots, slots + 3, idle=1.0)
    assert stalls[slots - 1] == 0, stalls  # `slots` forwards in flight: no wait yet
    assert stalls[slots] > 0, stalls  # the next one must wait for the oldest slot
    ahead = stalls.index(stalls[slots])  # forwards staged before the first stall
    lagging, sim = stage_ahead(make_sim, slots, 100, seed=1, idle=0.85, burst=0.05)
    steps = steps_ahead_of_a_stalled_device(make_sim, slots)
    record_property(f"forwards_ahead_{slots}_slots", ahead)
    record_property(f"standard_steps_ahead_{slots}_slots", steps)
    record_property(f"stalls_per_100_forwards_{slots}_slots", lagging[-1])
    print(f"\nstaging_slots={slots}: the host stages {ahead} forwards ({steps} whole "
          f"standard steps) ahead of a stalled device; {lagging[-1]} fence stalls per 100 "
          f"forwards against a seeded lagging device (max {sim.max_pending} ops queued)")


def steps_ahead_of_a_stalled_device(make_sim, slots: int, steps: int = 4) -> int:
    """Whole standard steps (small config) the host completes before its first fence
    stall when the device runs nothing on its own."""
    cfg = small_step_config()
    inputs = make_steps(cfg, steps, 0)  # the scheduler's host tensors, made outside
    sim = make_sim(0, idle=1.0)
    with sim:
        meta = MTPMetadata(**cfg.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=cfg.max_tokens, staging_slots=slots)
        view = ContextGPUView(cfg.max_requests, cfg.max_tokens, cfg.block_columns)
        sim.synchronize()
        done = 0
        for step in inputs:
            run_step(meta, view, step, cfg)
            if sim.stalls:
                break
            done += 1
        sim.synchronize()
        assert_no_hidden_copies(sim)
    return done
