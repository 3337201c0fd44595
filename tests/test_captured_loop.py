"""The captured draft loop (contract §12) against the default route, on both paths.

The main test captures a whole 3-depth draft loop (setup, a toy forward that appends
KV into a paged cache through the token maps and attends through the MHA fields, and
the advance) once at ``P`` with the CUDA-semantics simulator (``tests/cuda_sim.py``),
then replays it after ``begin_decode(n', P, ..., capture_setup=True)`` for ``n'`` in
``{P, P - 1, 1, 0}`` with fresh start positions, tables and inputs each step. The graph
snapshots the view, the cache and the draft buffers after every depth (static outputs,
as a real graph's), and they must equal what the default route writes on a twin object
for the same steps. Two negative controls, planted through the seams
(``mtpmeta.mirror.captured_route.mark_pad_rows``, ``mtpmeta.buffers.persistent.stage_count``), must make that
comparison fail.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mtpmeta.buffers.persistent as persistent_module
import mtpmeta.mirror.captured_route as captured_module
from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.mirror.captured_route import ADVANCE_OPS, DEPTH_OPS
from mtpmeta import ForwardModeError, GraphCaptureError, MTPForwardMode, StaleOffsetsError
from mtpmeta.simulate.paged import PagedKVCache
from tests.captured_helpers import (BS, CFG, CU_FIELDS, D, DEPTHS, FIELDS, P,
                                    PADDED_FIELDS, R, REAL_FIELDS, REPLAY_COUNTS,
                                    VIEW_TOKENS, W, run_depths, schedule)
from tests.cuda_sim import CudaSim, SimGraph
from tests.helpers import PATHS, assert_same_state, buffer_state, make_metadata

SIM_SKIP = pytest.mark.skipif(
    os.environ.get("MTPMETA_DEBUG") == "1",
    reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call")


def new_meta(path: str, **allocate: Any) -> MTPMetadata:
    meta = MTPMetadata(**CFG.metadata_kwargs())
    meta.allocate("cpu", mirror=(path == "mirror"), **allocate)
    return meta


def default_route_run(path: str, steps) -> List[List[Dict[str, torch.Tensor]]]:
    """The twin: the default route (eager setup per depth), same steps, plain CPU."""
    meta = new_meta(path)
    view = ContextGPUView(R, VIEW_TOKENS, W, "cpu")
    cache = PagedKVCache(CFG, torch.device("cpu"))
    x = torch.zeros(P, CFG.heads, CFG.head_dim)
    runs = []
    for n, starts, table, inputs in steps:
        x.copy_(inputs)
        meta.begin_decode(n, P, starts, table, True)
        runs.append(run_depths(meta, view, cache, x))
        meta.end_forward()
    return runs


def capture_loop(sim: CudaSim, meta: MTPMetadata, view: Any, cache: PagedKVCache,
                 x: torch.Tensor) -> Tuple[SimGraph, List[Dict[str, torch.Tensor]]]:
    """Capture a DEPTHS-depth loop (setup, toy forward, advance) after
    ``begin_decode_for_capture(P, capture_setup=True)``; returns the graph and the
    static snapshots every replay refreshes. Ends the forward."""
    graph = SimGraph()
    with sim.capture(graph):
        snaps = run_depths(meta, view, cache, x)
    meta.end_forward()
    return graph, snaps


def captured_run(path: str, steps, seed: int, *, capture_setup_begin: bool = True
                 ) -> Tuple[List[List[Dict[str, torch.Tensor]]], SimGraph, CudaSim]:
    """The captured loop under the simulator: one capture at ``P``, one replay per step
    after ``begin_decode(..., capture_setup=True)``. On the direct path the "device"
    buffers are CPU memory the numba kernels of ``begin_decode`` write at once, so the
    host drains the simulated device before it (a real CPU has nothing in flight)."""
    sim = CudaSim(seed)
    runs = []
    with sim:
        meta = new_meta(path)
        view = ContextGPUView(R, VIEW_TOKENS, W)
        cache = PagedKVCache(CFG, torch.device("cpu"))
        x = torch.zeros(P, CFG.heads, CFG.head_dim)
        sim.synchronize()
        meta.begin_decode_for_capture(P, capture_setup=True)
        syncs = sim.syncs
        graph, snaps = capture_loop(sim, meta, view, cache, x)
        assert sim.syncs == syncs and graph.pinned_reads == 0
        for n, starts, table, inputs in steps:
            sim.synchronize()
            with sim.bypass():
                x.copy_(inputs)
            if path == "direct":
                sim.synchronize()
            meta.begin_decode(n, P, starts, table, True, capture_setup=capture_setup_begin)
            graph.replay()
            meta.end_forward()
            sim.synchronize()
            runs.append([{name: sim.peek(t) for name, t in snap.items()} for snap in snaps])
    return runs, graph, sim


def differences(got_runs, want_runs) -> List[str]:
    """``differences_over`` for the steps of ``schedule``."""
    return differences_over(SCHEDULE_COUNTS, got_runs, want_runs)


def differences_over(counts, got_runs, want_runs) -> List[str]:
    """Every (step, depth, field) where the captured loop differs from the default
    route, over what the default route writes (KV caches compared NaN-equal);
    ``counts[i][0]`` is step ``i``'s real request count."""
    assert len(got_runs) == len(want_runs) == len(counts)
    bad = []
    for (n, *_), got_depths, want_depths in zip(counts, got_runs, want_runs):
        for depth, (got, want) in enumerate(zip(got_depths, want_depths)):
            parts = [(name, P) for name in PADDED_FIELDS] + [
                (name, n) for name in REAL_FIELDS] + [(name, P + 1) for name in CU_FIELDS]
            for name, length in parts:
                if not torch.equal(got[name][:length], want[name][:length].to(got[name].dtype)):
                    bad.append(f"n'={n} depth {depth}: {name}")
            for name in ("k_cache", "v_cache", "attention"):
                if not torch.equal(got[name].nan_to_num(12345.0),
                                   want[name].nan_to_num(12345.0)):
                    bad.append(f"n'={n} depth {depth}: {name}")
    return bad


SCHEDULE_COUNTS = [(n,) for n in REPLAY_COUNTS]


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("path", PATHS)
def test_captured_loop_replays_equal_the_default_route_for_every_count(path, seed):
    """A loop captured once at P replays for n' in {P, P-1, 1, 0}: after every depth
    the view, the KV written through it, the attention output and offsets[:n'] equal
    the default route's on a twin object. The capture synced nothing and recorded no
    pinned read."""
    steps = schedule(seed)
    got, graph, sim = captured_run(path, steps, seed)
    assert graph.items and sim.replays == len(steps)
    assert differences(got, default_route_run(path, steps)) == []
    # The comparison has teeth: the pad rows of the smaller replays point at D.
    last_step = got[-2][DEPTHS - 1]  # n' = 1
    assert last_step["token_to_block_idx"][1:P].tolist() == [D] * (P - 1)
    assert last_step["mha_block_table"][1:P].unique().tolist() == [-1]


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_replay_after_a_default_begin_decode_still_masks_the_pad_rows(path):
    """Every begin_decode stages the device count, not only a capture_setup one: a
    graph holding the captured setup, replayed after a default-route begin with
    n' < P, treats rows [n', P) as pad rows and equals the default route (before,
    the count kept the capture's P and stale rows wrote real KV)."""
    steps = schedule(2)
    got, _, _ = captured_run(path, steps, 2, capture_setup_begin=False)
    assert differences(got, default_route_run(path, steps)) == []


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_negative_control_pad_mask_removed_writes_real_kv_and_fails(path, monkeypatch):
    """Plant: the pad mask marks no row (pad rows [n', P) are treated as real). The
    replays with n' < P then write the pad rows' KV into the stale rows' real blocks,
    and the comparison must catch it in the KV cache itself."""
    monkeypatch.setattr(captured_module, "mark_pad_rows",
                        lambda row_ids, count, out: out.fill_(False))
    steps = schedule(0)
    got, _, _ = captured_run(path, steps, 0)
    bad = differences(got, default_route_run(path, steps))
    assert any("k_cache" in b for b in bad), bad
    assert not any(b.startswith(f"n'={P} ") for b in bad), bad  # n' = P has no pad rows


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_negative_control_count_not_restaged_fails(path, monkeypatch):
    """Plant: begin_decode does not restage the device count, so it keeps the
    capture's P. Every replay with n' < P then treats stale rows as real: the
    comparison must fail (KV cache included)."""
    monkeypatch.setattr(persistent_module, "stage_count", lambda head, count: None)
    steps = schedule(1)
    got, _, _ = captured_run(path, steps, 1)
    bad = differences(got, default_route_run(path, steps))
    assert any("k_cache" in b for b in bad), bad
    for n in REPLAY_COUNTS[1:]:
        assert any(b.startswith(f"n'={n} ") for b in bad), (n, bad)


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_captured_setup_is_a_fixed_op_sequence_with_no_host_read(path):
    """Captured alone, one setup_decode_step records DEPTH_OPS device ops, an advance
    ADVANCE_OPS, stage_decode_lengths 4; none reads pinned memory and nothing syncs.
    (On the direct path a numba kernel here would record nothing and replay nothing.)"""
    sim = CudaSim(3)
    with sim:
        meta = new_meta(path)
        view = ContextGPUView(R, VIEW_TOKENS, W)
        sim.synchronize()
        meta.begin_decode_for_capture(P, capture_setup=True)
        meta.setup_decode_step(view)  # plans built eagerly, as in a warm-up
        syncs, issued = sim.syncs, sim.issued
        graphs = [SimGraph() for _ in range(3)]
        with sim.capture(graphs[0]):
            meta.setup_decode_step(view)
        with sim.capture(graphs[1]):
            meta.advance_decode_step()
        with sim.capture(graphs[2]):
            meta.stage_decode_lengths()
        assert [len(g.items) for g in graphs] == [DEPTH_OPS, ADVANCE_OPS, 4]
        assert sum(g.pinned_reads for g in graphs) == 0
        assert sim.syncs == syncs and sim.issued == issued


@SIM_SKIP
@pytest.mark.cuda_sim
def test_mirror_begin_stages_count_offsets_and_table_in_one_copy():
    """begin_decode(capture_setup=True) on the mirror path: one pinned slot, one H2D
    copy (the count with the offsets and the table rows, into the private landing whose
    table part commit passes reuse rows from) and one device-to-device copy placing
    draft_head[:n + 1] and block_table[:n] from it (one _foreach_copy_; with n = 0 one
    copy_ of the count). It is eager staging, so it is refused under capture like the
    default begin_decode."""
    sim = CudaSim(4, idle=1.0)
    steps = schedule(2)
    with sim:
        meta = new_meta("mirror")
        sim.synchronize()
        for n, starts, table, _ in steps:
            issued, h2d = sim.issued, sim.h2d_copies
            meta.begin_decode(n, P, starts, table, True, capture_setup=True)
            assert sim.h2d_copies - h2d == 1, n
            assert sim.issued - issued == 2, n
            sim.synchronize()
            assert sim.peek(meta._captured.count).tolist() == [n]
            assert torch.equal(sim.peek(meta.offsets)[:n], starts[:n])
            assert torch.equal(sim.peek(meta.block_table)[:n], table[:n])
        with pytest.raises(GraphCaptureError, match="begin_decode"):
            with sim.capture(SimGraph()):
                meta.begin_decode(2, P, steps[0][1], steps[0][2], True, capture_setup=True)


# ----------------------------------------------------------- eager, no simulator
def default_and_captured(path: str, n: int, padded: int, starts, table, depths: int):
    """Per depth: (captured view state, default view state, shapes) run eagerly."""
    pairs = []
    cap, ref = new_meta(path), new_meta(path)
    views = (ContextGPUView(R, VIEW_TOKENS, W, "cpu"), ContextGPUView(R, VIEW_TOKENS, W, "cpu"))
    cap.begin_decode_for_capture(padded, capture_setup=True)
    cap.setup_decode_step(views[0])
    cap.begin_decode(n, padded, starts, table, False, capture_setup=True)
    ref.begin_decode(n, padded, starts, table, True)
    for _ in range(depths):
        shapes = (cap.setup_decode_step(views[0]), ref.setup_decode_step(views[1]))
        pairs.append(([(name, getattr(views[0], name).clone()) for name in FIELDS],
                      [(name, getattr(views[1], name).clone()) for name in FIELDS],
                      cap.offsets.clone(), ref.offsets.clone(), shapes))
        cap.advance_decode_step()
        ref.advance_decode_step()
    return cap, ref, pairs


@settings(max_examples=30, deadline=None)
@given(path=st.sampled_from(PATHS), padded=st.integers(0, R), data=st.data())
def test_eager_captured_route_equals_default_route(path, padded, data):
    """Run eagerly (no capture), the captured route writes what the default route
    writes, for any n <= padded, and reports the graphed ForwardShape
    (capture_setup=True implies graphed=True even when graphed=False is passed)."""
    n = data.draw(st.integers(0, padded))
    starts = torch.tensor(data.draw(st.lists(st.integers(0, W * BS - 4), min_size=R,
                                             max_size=R)), dtype=torch.int32)
    table = torch.tensor(data.draw(st.lists(st.integers(0, D - 1), min_size=R * W,
                                            max_size=R * W)), dtype=torch.int32).view(R, W)
    cap, _, pairs = default_and_captured(path, n, padded, starts, table, 3)
    assert cap.graphed and cap.active_request_count == n and cap.padded_count == padded
    for depth, (mine, theirs, offsets, ref_offsets, (shape, ref_shape)) in enumerate(pairs):
        assert shape == ref_shape and shape.max_seqlen_k == W * BS
        assert torch.equal(offsets[:n], ref_offsets[:n]), depth
        for (name, a), (_, b) in zip(mine, theirs):
            length = {**{f: padded for f in PADDED_FIELDS}, **{f: padded + 1 for f in CU_FIELDS}
                      }.get(name, n)
            assert torch.equal(a[:length], b[:length]), (depth, name, a, b)


@pytest.mark.parametrize("path", PATHS)
def test_captured_position_past_the_table_goes_to_dummy(path):
    """The device cannot raise: a real row whose offset reaches W * BS writes block D
    (local 0), while its other rows are unaffected. Example: W*BS = 24, starts
    [23, 5] -> depth 0 blocks [t0[5], t1[1]], depth 1 blocks [D, t1[1]]."""
    meta = new_meta(path)
    view = ContextGPUView(R, VIEW_TOKENS, W, "cpu")
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    meta.begin_decode(2, 3, torch.tensor([W * BS - 1, 5] + [0] * (R - 2), dtype=torch.int32),
                      table, True, capture_setup=True)
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:3].tolist() == [5, W + 1, D]
    meta.advance_decode_step()
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:3].tolist() == [D, W + 1, D]
    assert view.token_to_local_position_within_kv_block[:3].tolist() == [0, 2, 0]
    assert view.mha_kv_seq_lengths[:3].tolist() == [W * BS + 1, 7, 0]


@pytest.mark.parametrize("path", PATHS)
def test_captured_unallocated_block_goes_to_dummy(path):
    """The default route refuses a -1 (unallocated) block in a column a row writes; the
    device cannot raise, so the captured route sends that token to D instead of writing
    block -1. Example: row 0 at position 5 (column 1) with table[0, 1] = -1."""
    meta = new_meta(path)
    view = ContextGPUView(R, VIEW_TOKENS, W, "cpu")
    table = torch.arange(R * W, dtype=torch.int32).view(R, W).clone()
    table[0, 1] = -1
    meta.begin_decode(2, 3, torch.tensor([5, 5] + [0] * (R - 2), dtype=torch.int32),
                      table, True, capture_setup=True)
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:3].tolist() == [D, W + 1, D]


@pytest.mark.parametrize("path", PATHS)
def test_default_route_call_after_a_captured_depth_raises_until_begin_decode(path):
    """After a captured depth the host copy of the offsets is stale: once the captured
    loop ends, advance_decode_step and stage_decode_lengths (default route) raise
    (ForwardModeError outside DRAFT, StaleOffsetsError when DRAFT is re-entered by hand)
    and change nothing; a new begin_decode clears it."""
    meta = new_meta(path)
    view = ContextGPUView(R, VIEW_TOKENS, W, "cpu")
    starts = torch.arange(R, dtype=torch.int32)
    table = torch.zeros((R, W), dtype=torch.int32)
    meta.begin_decode(3, P, starts, table, True, capture_setup=True)
    meta.setup_decode_step(view)
    meta.advance_decode_step()
    meta.end_forward()
    before = buffer_state(meta)
    for method in (meta.advance_decode_step, meta.stage_decode_lengths):
        with pytest.raises(ForwardModeError, match="begin_decode"):  # outside DRAFT
            method()
    assert_same_state(before, buffer_state(meta))
    meta.forward_mode = MTPForwardMode.DRAFT  # upstream style: back into DRAFT by hand
    before = buffer_state(meta)
    for method in (meta.advance_decode_step, meta.stage_decode_lengths):
        with pytest.raises(StaleOffsetsError, match="begin_decode"):
            method()
    assert_same_state(before, buffer_state(meta))
    meta.begin_decode(3, P, starts, table, True)
    meta.advance_decode_step()
    assert meta.offsets[:3].tolist() == [1, 2, 3]


@pytest.mark.parametrize("path", PATHS)
def test_captured_begin_refuses_bad_start_before_any_write(path):
    """A start position past the table is refused (ValueError naming it) before any
    buffer, the device count included, is written."""
    meta = make_metadata(path)
    meta.begin_decode(2, 4, torch.tensor([1, 2]), torch.zeros((2, 6), dtype=torch.int32),
                      True, capture_setup=True)
    before = buffer_state(meta)
    count = meta._captured.count.clone()
    with pytest.raises(ValueError, match="start_positions"):
        meta.begin_decode(2, 4, torch.tensor([1, 6 * 4]), torch.zeros((2, 6), dtype=torch.int32),
                          True, capture_setup=True)
    assert_same_state(before, buffer_state(meta))
    assert torch.equal(count, meta._captured.count)


@pytest.mark.parametrize("path", PATHS)
def test_captured_stage_decode_lengths_masks_pad_rows(path):
    """stage_decode_lengths in a captured loop: [:n] as the default route, rows
    [n, padded) zero (they are written, masked, so a captured graph may read them)."""
    meta = new_meta(path)
    meta.begin_decode(2, 4, torch.tensor([3, 9] + [7] * (R - 2), dtype=torch.int32),
                      torch.zeros((R, W), dtype=torch.int32), True, capture_setup=True)
    meta.query_lengths.fill_(5)
    meta.kv_lengths.fill_(5)
    q, kv = meta.stage_decode_lengths()
    assert q.tolist() == [1, 1] and kv.tolist() == [4, 10]
    assert meta.query_lengths[:5].tolist() == [1, 1, 0, 0, 5]
    assert meta.kv_lengths[:5].tolist() == [4, 10, 0, 0, 5]


def test_mirror_captured_begin_with_device_start_positions(device_route):
    """Device-tensor inputs (mirror path) take the device copies and a device fill of
    the count, with the same results as host inputs."""
    starts = torch.tensor([4, 8, 1, 0, 0, 0, 0, 0], dtype=torch.int32)
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    metas = [new_meta("mirror"), new_meta("mirror")]
    views = [ContextGPUView(R, VIEW_TOKENS, W, "cpu") for _ in metas]
    metas[0].begin_decode(3, 5, starts, table, True, capture_setup=True)
    assert metas[0]._captured.count.tolist() == [3]
    metas[0].setup_decode_step(views[0])
    metas[1].begin_decode(3, 5, starts.numpy(), table.numpy(), True, capture_setup=True)
    metas[1].setup_decode_step(views[1])
    for name in FIELDS:
        assert torch.equal(getattr(views[0], name), getattr(views[1], name)), name


def test_readme_captured_example_runs():
    """The README's captured-loop example runs as written (eagerly on the CPU) and its
    assertion about the pad rows and the depth-2 blocks holds."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Captured draft loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: Dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["outputs"][-1].tolist() == [0, 5, 8, 14, 16, 99, 99, 99]
    assert len(namespace["outputs"]) == DEPTHS


def test_bench_captured_row_counts_only_begin_decode_on_the_host():
    """The bench's captured row: the host side of a captured loop is begin_decode alone
    (2 data ops on the mirror path, none on the direct path), with no sync and no
    allocation, against the default graphed loop's per-depth staging; the graph holds
    DEPTH_OPS + ADVANCE_OPS per depth."""
    from mtpmeta.bench.measure import measure_captured
    from mtpmeta.bench.report import format_captured
    from mtpmeta.bench.workload import StepConfig, make_steps

    config = StepConfig(max_requests=16, block_columns=8, block_size=4, active=10,
                        depths=3, prefill_tokens=12, inherited_blocks=2, tp=4, moves=2,
                        swaps=1, resets=2, hidden_size=8)
    result = measure_captured(config, make_steps(config, 2), 1, torch.device("cpu"))
    assert set(result) == {"direct", "mirror"}
    assert result["mirror"]["captured_host_data_ops"] == 2
    assert result["direct"]["captured_host_data_ops"] == 0
    assert result["mirror"]["default_graphed_data_ops"] > 3
    for row in result.values():
        assert row["captured_host_syncs"] == 0 and row["captured_host_allocations"] == 0
        assert (row["graph_ops_setup"], row["graph_ops_advance"]) == (DEPTH_OPS, ADVANCE_OPS)
    assert "replays are excluded" in format_captured(result, config.depths)


def lagging_captured_run(steps, disable_fences: bool):
    """The captured loop on the mirror path with a device that lags far behind and no
    host sync between steps: each step's begin_decode reuses a pinned slot while the
    copies of earlier steps may still be queued. After each replay the graph's static
    outputs are cloned on the stream (queued too), then everything is drained once."""
    sim = CudaSim(7, idle=0.97, disable_fences=disable_fences)
    kept = []
    with sim:
        meta = new_meta("mirror", staging_slots=2)  # 8 steps wrap the begin ring
        view = ContextGPUView(R, VIEW_TOKENS, W)
        cache = PagedKVCache(CFG, torch.device("cpu"))
        x = torch.zeros(P, CFG.heads, CFG.head_dim)
        sim.synchronize()
        with sim.bypass():
            x.copy_(steps[0][3])
        meta.begin_decode_for_capture(P, capture_setup=True)
        graph, snaps = capture_loop(sim, meta, view, cache, x)
        syncs = sim.syncs
        for n, starts, table, _ in steps:
            meta.begin_decode(n, P, starts, table, True, capture_setup=True)
            graph.replay()
            meta.end_forward()
            kept.append([{name: t.clone() for name, t in snap.items()} for snap in snaps])
        assert sim.syncs == syncs  # the host never waited on the whole device
        sim.synchronize()
        return [[{name: sim.peek(t) for name, t in snap.items()} for snap in step]
                for step in kept], sim


def _lagging_steps():
    first, second = schedule(5), schedule(6)
    x = first[0][3]
    return [(n, starts, table, x) for n, starts, table, _ in first + second]


@SIM_SKIP
@pytest.mark.cuda_sim
def test_back_to_back_captured_steps_on_a_lagging_device_stay_correct():
    """Eight captured steps issued back to back while the device lags: the fenced
    pinned ring of begin_decode never hands out a slot whose copies are pending, so
    every depth of every step still equals the default route."""
    steps = _lagging_steps()
    got, sim = lagging_captured_run(steps, disable_fences=False)
    assert sim.stalls > 0  # the ring did wait on a pending slot: the race was live
    want = default_route_run("mirror", steps)
    counts = [(n,) for n, *_ in steps]
    assert differences_over(counts, got, want) == []


@SIM_SKIP
@pytest.mark.cuda_sim
def test_negative_control_unfenced_begin_ring_corrupts_later_steps():
    """Plant: no-op fences. A begin_decode then rewrites a pinned slot whose copies of
    an earlier step have not run yet, that step stages the later step's count, offsets
    and table, and the comparison must fail."""
    steps = _lagging_steps()
    got, _ = lagging_captured_run(steps, disable_fences=True)
    want = default_route_run("mirror", steps)
    assert differences_over([(n,) for n, *_ in steps], got, want) != []


@SIM_SKIP
@pytest.mark.cuda_sim
def test_captured_begin_never_rewrites_the_pinned_table_of_a_pending_default_loop():
    """A default-route draft loop whose depths are still queued on a lagging device,
    then at once a captured begin_decode with another table: on the mirror path the
    default loop's host table is its pinned begin slot, which its pending copies still
    read. The captured begin must stage through its own memory, so every queued depth
    of the default loop still sees that loop's own table. (No toy forward here: the
    host must not wait on the device between the two begins.)"""
    (n, starts, table, _), (n2, starts2, table2, _) = schedule(11)[:2]
    twin = new_meta("mirror")
    twin_view = ContextGPUView(R, VIEW_TOKENS, W, "cpu")
    twin.begin_decode(n, P, starts, table, True)
    want = []
    for _ in range(DEPTHS):
        twin.setup_decode_step(twin_view)
        want.append({name: getattr(twin_view, name).clone() for name in FIELDS})
        twin.advance_decode_step()
    sim = CudaSim(9, idle=1.0)  # the device runs nothing until the host waits
    with sim:
        meta = new_meta("mirror")
        view = ContextGPUView(R, VIEW_TOKENS, W)
        sim.synchronize()
        syncs = sim.syncs
        meta.begin_decode(n, P, starts, table, True)
        kept = []
        for _ in range(DEPTHS):
            meta.setup_decode_step(view)
            kept.append({name: getattr(view, name).clone() for name in FIELDS})
            meta.advance_decode_step()
        meta.end_forward()
        meta.begin_decode(n2, P, starts2, table2, True, capture_setup=True)
        meta.end_forward()
        assert sim.syncs == syncs  # the default loop's copies may still be pending
        sim.synchronize()
        got = [{name: sim.peek(t) for name, t in snap.items()} for snap in kept]
    for depth, (ours, theirs) in enumerate(zip(got, want)):
        for name in PADDED_FIELDS[:2] + ("mha_block_table",):
            assert torch.equal(ours[name][:P], theirs[name][:P]), f"depth {depth}: {name}"
