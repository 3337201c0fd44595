"""The captured draft loop's safety rules (contract §12): stream order,
bounded pad-row positions, stale host offsets, recapture after ``allocate``, block ids
checked at every host begin, and the device count a capture begin stages.

Geometry: ``tests.helpers.config`` (R 8, W 6, BS 4, D 999, int32 tables). The simulator
tests (``tests/cuda_sim.py``) replay real captured graphs; the eager ones run the same
device ops on plain CPU tensors.
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch

from mtpmeta import ContextGPUView, MTPForwardMode, MTPMetadata, StaleOffsetsError
from mtpmeta.mirror.captured_route import DEPTH_OPS
from tests.cuda_sim import CudaSim, SimGraph
from tests.helpers import (PATHS, assert_same_state, buffer_state, config, make_metadata,
                           view_state)

SIM_SKIP = pytest.mark.skipif(
    os.environ.get("MTPMETA_DEBUG") == "1",
    reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call")

KW = config()
R, W, BS, D = (KW["max_requests"], KW["max_kv_block_count"], KW["block_size_tokens"],
               KW["dummy_block_idx"])
P, DEPTHS, TOKENS = 4, 3, 16
TABLE = torch.arange(R * W, dtype=torch.int32).view(R, W)  # row r: blocks r*W ..


def _sim_meta(path: str = "mirror") -> MTPMetadata:
    """An allocated object inside an active simulator (its buffers are device ones)."""
    meta = MTPMetadata(**KW)
    meta.allocate("cpu", mirror=(path == "mirror"), max_tokens=64)
    return meta


def _starts(*values: int) -> torch.Tensor:
    """Host start positions ``[R]``: ``values`` then zeros (torch.from_numpy, so a
    host tensor under the simulator too)."""
    starts = np.zeros(R, dtype=np.int32)
    starts[:len(values)] = values
    return torch.from_numpy(starts)


def _depths(meta: MTPMetadata, view: Any, count: int = DEPTHS) -> None:
    for _ in range(count):
        meta.setup_decode_step(view)
        meta.advance_decode_step()


# ------------------------------------------------------------------ stream order
def _two_stream_steps(seed: int) -> Tuple[int, int]:
    """Six captured loops: ``begin_decode(capture_setup=True)`` on stream a, an eager
    captured depth and advance on stream b (a forward on b reads the view). Returns how
    many steps' depth 0 differ from what the inputs give (block, position, KV length
    and table row of every real row), and the stream switches the order made."""
    rng = np.random.default_rng(seed)
    sim = CudaSim(seed, idle=0.9)
    a, b = sim.Stream("a"), sim.Stream("b")
    kept, cases = [], []
    with sim:
        meta = _sim_meta()
        view = ContextGPUView(R, 64, W)
        sim.synchronize()
        for _ in range(6):
            n = int(rng.integers(1, R + 1))
            starts = rng.integers(0, W * BS - 3, size=R).astype(np.int32)
            table = rng.permutation(R * W).reshape(R, W).astype(np.int32)
            cases.append((n, starts, table))
            with sim.stream(a):
                meta.begin_decode(n, n, torch.from_numpy(starts), torch.from_numpy(table),
                                  True, capture_setup=True)
            with sim.stream(b):
                meta.setup_decode_step(view)
                kept.append([getattr(view, name).clone() for name in (
                    "token_to_block_idx", "token_to_pos_ids", "mha_kv_seq_lengths",
                    "mha_block_table")])
                meta.advance_decode_step()
                meta.end_forward()
        sim.synchronize()
        switches = meta._backend.stream_order.switches
        got = [[sim.peek(t) for t in snap] for snap in kept]
    wrong = 0
    for (n, starts, table), fields in zip(cases, got):
        s = starts[:n].astype(np.int64)
        want = (table[np.arange(n), s // BS], s, s + 1, table[:n])
        wrong += any(not np.array_equal(g[:n].numpy(), w) for g, w in zip(fields, want))
    return wrong, switches


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_captured_route_is_ordered_after_a_begin_on_another_stream(seed):
    """Run eagerly, the captured route enters the persistent buffers' stream order,
    as the default route does: depths on stream b read what the begin on stream a
    staged, and the next begin on a waits for b's depth and advance (before, 5 or 6
    of 6 steps per seed read stale offsets, table and count)."""
    wrong, switches = _two_stream_steps(seed)
    assert wrong == 0
    assert switches >= 2 * 6 - 1  # a -> b and b -> a at every step but the first


@SIM_SKIP
@pytest.mark.cuda_sim
def test_captured_route_inside_a_capture_records_no_stream_order():
    """Stream order inside a capture: after a begin on stream a, a captured depth, advance and
    length staging on the capture's side stream record their device ops only: no event
    is recorded or waited on (the order's switch count is unchanged), and nothing
    syncs."""
    sim = CudaSim(5)
    a = sim.Stream("a")
    with sim:
        meta = _sim_meta()
        view = ContextGPUView(R, 64, W)
        sim.synchronize()
        with sim.stream(a):
            meta.begin_decode_for_capture(P, capture_setup=True)
            meta.setup_decode_step(view)  # plans built eagerly, on a
        order = meta._backend.stream_order
        switches, syncs = order.switches, sim.syncs
        graph = SimGraph()
        with sim.capture(graph):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
            meta.stage_decode_lengths()
        assert order.switches == switches and sim.syncs == syncs
        assert len(graph.items) == DEPTH_OPS + 1 + 4


# ------------------------------------------------------ pad-row positions bounded
@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_pad_row_positions_stay_zero_under_many_low_load_replays(path):
    """Every replay advances offsets[:P], pad rows included, and a begin rewrites
    only offsets[:n']. One busy step (n' = P near the table's end), then 20 steps with
    n' = 1 from position 0: after every replay the pad rows' token_to_pos_ids and
    token_to_position_in_request are 0 and their tokens go to D (before, they grew by
    DEPTHS per replay, to 82 at step 20, past the largest real position W*BS-1 =
    23), and the real row writes its own position."""
    sim = CudaSim(6)
    with sim:
        meta = _sim_meta(path)
        view = ContextGPUView(R, 64, W)
        sim.synchronize()
        meta.begin_decode_for_capture(P, capture_setup=True)
        graph = SimGraph()
        with sim.capture(graph):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
            meta.setup_decode_step(view)
            meta.advance_decode_step()
            meta.setup_decode_step(view)  # the last depth: its view is the one read
            meta.advance_decode_step()
        meta.end_forward()
        seen = []
        for step, (n, start) in enumerate([(P, W * BS - 4)] + [(1, 0)] * 20):
            if path == "direct":
                sim.synchronize()  # the numba begin writes the "device" at once
            meta.begin_decode(n, P, _starts(*[start] * n), TABLE, True, capture_setup=True)
            graph.replay()
            meta.end_forward()
            sim.synchronize()
            seen.append([sim.peek(getattr(view, name))[:P].tolist() for name in (
                "token_to_pos_ids", "token_to_position_in_request", "token_to_block_idx",
                "token_to_local_position_within_kv_block")])
    assert seen[0][0] == [W * BS - 2] * P  # the busy step: all rows real
    for step, (pos, in_request, blocks, local) in enumerate(seen[1:], 1):
        assert pos == in_request == [DEPTHS - 1] + [0] * (P - 1), step
        assert blocks == [0] + [D] * (P - 1) and local == [DEPTHS - 1] + [0] * (P - 1), step


@pytest.mark.parametrize("path", PATHS)
def test_eager_captured_depths_write_pad_row_positions_as_zero(path):
    """Pad-row positions, eagerly (the same device ops): pad rows whose offsets earlier loops advanced
    far get position 0 at every depth, block D and local 0; real rows are unchanged.
    Example: a loop with n = P from 20, then n = 1 from 5: pad offsets are 23.., yet
    pad positions are 0, real row 0 writes 5, 6, 7."""
    meta = make_metadata(path)
    view = ContextGPUView(R, TOKENS, W, "cpu")
    meta.begin_decode_for_capture(P, capture_setup=True)
    meta.begin_decode(P, P, _starts(*[20] * P), TABLE, True, capture_setup=True)
    _depths(meta, view)
    meta.begin_decode(1, P, _starts(5), TABLE, True, capture_setup=True)
    for depth in range(DEPTHS):
        meta.setup_decode_step(view)
        assert meta.offsets[1:P].tolist() == [23 + depth] * (P - 1)  # pad rows advanced
        assert view.token_to_pos_ids[:P].tolist() == [5 + depth] + [0] * (P - 1)
        assert view.token_to_position_in_request[:P].tolist() == [5 + depth] + [0] * (P - 1)
        assert view.token_to_block_idx[:P].tolist() == [1] + [D] * (P - 1)
        assert view.mha_kv_seq_lengths[:P].tolist() == [6 + depth] + [0] * (P - 1)
        meta.advance_decode_step()


# ------------------------------------------------------------ stale host offsets
def _refused_all(meta: MTPMetadata, view: Any) -> None:
    """Every default-route draft call raises StaleOffsetsError and writes nothing."""
    before, before_view = buffer_state(meta), view_state(view)
    for call in (lambda: meta.setup_decode_step(view), meta.advance_decode_step,
                 meta.stage_decode_lengths):
        with pytest.raises(StaleOffsetsError, match="capture_setup=True.*begin_decode"):
            call()
    assert_same_state(before, buffer_state(meta))
    after_view = view_state(view)
    for name, tensor in before_view.items():
        assert torch.equal(tensor, after_view[name]), name


@pytest.mark.parametrize("how", ["begin only (a replay runs no host code)",
                                 "host-run captured depths", "capture begin"])
@pytest.mark.parametrize("path", PATHS)
def test_default_route_after_a_captured_begin_refuses_stale_offsets(path, how):
    """A captured begin marks the host offsets stale whether or not host code runs
    its depths (a graph replay runs none): after end_forward and ``forward_mode =
    DRAFT`` by hand, setup_decode_step, advance_decode_step and stage_decode_lengths of
    the default route raise StaleOffsetsError and write nothing (before, only an
    advance after host-run depths was refused, and setup_decode_step never). A default
    begin clears it."""
    meta = make_metadata(path)
    view = ContextGPUView(R, TOKENS, W, "cpu")
    if how == "capture begin":
        meta.begin_decode_for_capture(P, capture_setup=True)
    else:
        meta.begin_decode(3, P, _starts(1, 2, 3), TABLE, True, capture_setup=True)
        if how == "host-run captured depths":
            _depths(meta, view)
    meta.end_forward()
    meta.forward_mode = MTPForwardMode.DRAFT  # upstream style
    _refused_all(meta, view)
    meta.begin_decode(3, P, _starts(1, 2, 3), TABLE, True)
    meta.setup_decode_step(view)
    assert view.token_to_pos_ids[:3].tolist() == [1, 2, 3]


@SIM_SKIP
@pytest.mark.cuda_sim
def test_default_route_after_a_replay_is_refused():
    """Stale host offsets in the production flow: captured begin, graph.replay(), end_forward, DRAFT by
    hand: a default-route depth would write the view from host offsets DEPTHS behind
    the device's; it is refused, and the view keeps what the replay wrote."""
    sim = CudaSim(8)
    with sim:
        meta = _sim_meta()
        view = ContextGPUView(R, 64, W)
        sim.synchronize()
        meta.begin_decode_for_capture(P, capture_setup=True)
        graph = SimGraph()
        with sim.capture(graph):
            _depths(meta, view)
        meta.end_forward()
        meta.begin_decode(P, P, _starts(1, 2, 3, 4), TABLE, True, capture_setup=True)
        graph.replay()
        meta.end_forward()
        meta.forward_mode = MTPForwardMode.DRAFT
        for call in (lambda: meta.setup_decode_step(view), meta.advance_decode_step,
                     meta.stage_decode_lengths):
            with pytest.raises(StaleOffsetsError):
                call()
        sim.synchronize()
        assert sim.peek(view.token_to_pos_ids)[:P].tolist() == [3, 4, 5, 6]
        assert sim.peek(meta.offsets)[:P].tolist() == [4, 5, 6, 7]


# ------------------------------------------------------ recapture after allocate()
@pytest.mark.parametrize("path", PATHS)
def test_captured_begin_after_reallocate_demands_a_recapture(path):
    """A graph captured at P holds the buffers' addresses; after deallocate() and
    allocate() a captured begin at P is refused (ValueError naming the recapture,
    nothing written) until begin_decode_for_capture(P, capture_setup=True) runs on the
    new buffers. Other padded counts, and default-route begins, are not affected."""
    meta = make_metadata(path)
    view = ContextGPUView(R, TOKENS, W, "cpu")
    meta.begin_decode_for_capture(P, capture_setup=True)
    meta.end_forward()
    meta.deallocate()
    meta.allocate("cpu", mirror=(path == "mirror"))
    before = buffer_state(meta)
    with pytest.raises(ValueError, match=rf"padded_count={P} .*allocate\(\).*"
                                         rf"begin_decode_for_capture\({P}, capture_setup"):
        meta.begin_decode(2, P, _starts(1, 2), TABLE, True, capture_setup=True)
    assert_same_state(before, buffer_state(meta))
    meta.begin_decode(2, P + 1, _starts(1, 2), TABLE, True, capture_setup=True)  # never
    meta.begin_decode(2, P, _starts(1, 2), TABLE, True)  # prepared / the default route
    meta.begin_decode_for_capture(P, capture_setup=True)  # the recapture
    meta.begin_decode(2, P, _starts(1, 2), TABLE + 100, True, capture_setup=True)
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:P].tolist() == [100, 106, D, D]


# ------------------------------------------------- ids at every host-input begin
def _int16_view() -> Any:
    view = ContextGPUView(R, TOKENS, W, "cpu")
    view.token_to_block_idx = torch.zeros(TOKENS, dtype=torch.int16)
    view.mha_block_table = torch.zeros((R, W), dtype=torch.int16)
    return view


@pytest.mark.parametrize("path", PATHS)
def test_default_begin_refuses_ids_a_captured_views_dtype_cannot_hold(path):
    """A graph holding the captured setup may replay after a default-route begin,
    so once a captured depth ran on an int16 view, a default-route begin with block id
    40000 (an int32 table holds it) is refused too, changing nothing (accepted, the
    replay would write -25536, another block). Before any captured depth the same begin is
    accepted, and a table that fits still is afterwards."""
    meta = make_metadata(path)
    view = _int16_view()
    table = TABLE.clone()
    table[0, 0] = 40000
    meta.begin_decode(P, P, _starts(), table, True)  # no captured depth yet: accepted
    meta.end_forward()
    meta.begin_decode_for_capture(P, capture_setup=True)
    meta.setup_decode_step(view)  # the depth a graph would capture
    meta.end_forward()
    before = buffer_state(meta)
    with pytest.raises(ValueError, match=r"block id 40000 at \[0, 0\] does not fit the "
                                         r"dtype of a view a captured depth wrote "
                                         r"torch.int16"):
        meta.begin_decode(P, P, _starts(), table, True)
    assert_same_state(before, buffer_state(meta))
    meta.begin_decode(P, P, _starts(), TABLE, True)
    assert meta.block_table[:P].tolist() == TABLE[:P].tolist()


# ------------------------------------------- behaviour: the capture begin's count
def _after_capture_begin(sim: CudaSim, path: str) -> List[List[int]]:
    """A smaller default loop (n = 2) first, then begin_decode_for_capture(6,
    capture_setup=True), a depth captured there and replayed: the device count and the
    replay's lengths (view and persistent buffers) and table column 0."""
    padded = 6
    with sim:
        meta = _sim_meta(path)
        view = ContextGPUView(R, 64, W)
        sim.synchronize()
        meta.begin_decode(2, 2, _starts(), torch.from_numpy(np.zeros((R, W), np.int32)),
                          False)
        meta.setup_decode_step(view)
        meta.end_forward()
        sim.synchronize()
        meta.begin_decode_for_capture(padded, capture_setup=True)
        graph = SimGraph()
        with sim.capture(graph):
            meta.setup_decode_step(view)
        meta.end_forward()
        graph.replay()
        sim.synchronize()
        return [sim.peek(meta._captured.count).tolist()] + [
            sim.peek(t)[:padded].tolist() for t in (
                view.mha_query_lengths, view.mha_kv_seq_lengths, meta.query_lengths,
                meta.kv_lengths, view.mha_block_table[:, 0], view.token_to_block_idx)]


@SIM_SKIP
@pytest.mark.cuda_sim
@pytest.mark.parametrize("path", PATHS)
def test_capture_begin_makes_every_padded_row_real_for_a_replay(path):
    """begin_decode_for_capture(6, capture_setup=True) after a loop with n = 2 stages
    the device count 6 (on the mirror path a device fill, not the begin copy), so the
    replayed depth writes query 1 and KV 1 on all 6 rows, view and persistent lengths
    alike, and block D in every token and table row; a count left at 2 would mask rows
    [2, 6) as pad rows (zero lengths, -1 table rows)."""
    count, q, kv, q_buf, kv_buf, table, blocks = _after_capture_begin(CudaSim(1), path)
    assert q == kv == q_buf == kv_buf == [1] * 6
    assert table == blocks == [D] * 6
    assert count == [6]
