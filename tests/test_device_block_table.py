"""``setup_commit_pass(..., device_block_table=...)``: the commit pass's table rows
placed from the caller's device copy of them.

Failure story: an engine that already copied the commit pass's block-table rows to the
device (Megatron's controller makes that ``.to(device)`` copy every step) pays again
when the library ships the host rows across: on a wide table that is a pass over
``[P, W]`` bound by memory bandwidth, every step. With the device copy given, the view's
``mha_block_table`` rows come from it on the device, while the host rows still place
and check every block a token writes. A route that took the wrong rows, the wrong
number of them (a full batch's pad-absorbing request is cut back by the host), or the
device copy of a paused row, would send attention to another request's KV; so every
byte is compared with the reference, and a device copy that differs from the host rows
on purpose shows which bytes each side placed.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

from mtpmeta import ContextGPUView, MTPMetadata
from tests.helpers import (assert_buffers_equal, assert_results_equal, assert_same_state,
                           assert_views_equal, buffer_state, config, make_reference,
                           make_views, view_state)
from tests.test_cuda_sim import make_sim  # noqa: F401 (the fixture)
from tests.test_cuda_sim import new_pair as sim_pair
from tests.test_differential import annotate, geometries, new_pair
from tests.test_differential_steps import commit_inputs, quick
from tests.test_sim_hazards import upload

R, W, BS, D = 8, 6, 4, 999  # tests.helpers.config


def _copy(table, dtype=torch.int32):
    """A device copy (here: a new CPU tensor) of a built host table of any form."""
    host = table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
    return torch.from_numpy(np.ascontiguousarray(host)).to(dtype)


def _both(pair, counts, tab, kwargs, device_rows):
    """The commit pass on both sides of ``pair``; the library's with ``device_rows``
    (the built host table -> its device copy) as ``device_block_table``."""
    results = []
    for meta, view in pair._sides():
        memo = {}
        args = [pair._build(x, meta, view, memo) for x in (counts, tab)]
        extra = {key: pair._build(x, meta, view, memo) for key, x in kwargs.items()}
        if meta is pair.lib:
            extra["device_block_table"] = device_rows(args[1])
        results.append(meta.setup_commit_pass(view, *args, **extra))
    assert_results_equal(results[0], results[1], pair.lib, pair.ref, "setup_commit_pass")
    pair.check("setup_commit_pass with device_block_table")


@quick
@given(data=st.data())
def test_device_rows_leave_the_references_bytes(path, data):
    """Any commit pass (padding, full-batch absorption, inherited blocks, start
    positions) with the host table's device copy: every byte the reference's."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    annotate(pair, data, g)
    counts, tab, kwargs = data.draw(commit_inputs(g), label="commit")
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="device dtype")
    _both(pair, counts, tab, kwargs, lambda table: _copy(table, dtype))


@quick
@given(data=st.data())
def test_full_batch_absorption_takes_the_cut_row_from_the_host(data):
    """P == R with pad tokens: the last request's row is cut back (the dummy block past
    its span) on the host; the device copy gives the rows before it."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, "mirror", g)
    counts, tab, kwargs = data.draw(commit_inputs(g, P=g.R, pad=True), label="commit")
    _both(pair, counts, tab, kwargs, _copy)


def _meta(mirror: bool = True):
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=mirror)
    view, _ = make_views(meta)
    return meta, view


HOST = np.arange(R * W, dtype=np.int32).reshape(R, W)  # real block ids, never D
COUNTS = np.array([3, 5, 2], dtype=np.int32)
STARTS = np.array([0, 6, 9], dtype=np.int32)


def test_the_view_s_table_rows_are_the_device_copy_s_and_its_blocks_the_host_s():
    """A device copy unlike the host rows (the caller's contract broken on purpose):
    the view's ``mha_block_table`` rows are the device copy's, every token's block the
    host rows'. So the rows came from the device, and the blocks KV is written to were
    checked on the host."""
    meta, view = _meta()
    device = torch.as_tensor(HOST[:3] + 100)
    meta.setup_commit_pass(view, COUNTS, HOST[:3], start_positions=STARTS,
                           padded_request_count=4, device_block_table=device)
    assert torch.equal(view.mha_block_table[:3], device)
    assert (view.mha_block_table[3] == -1).all()  # the pad row
    ref, ref_view = make_reference(), make_views(meta)[1]
    ref.setup_commit_pass(ref_view, COUNTS, HOST[:3], start_positions=STARTS,
                          padded_request_count=4)
    assert torch.equal(view.token_to_block_idx, ref_view.token_to_block_idx)


def test_the_direct_path_writes_the_host_rows():
    """On the direct path (buffers on the host) the host rows are written."""
    meta, view = _meta(mirror=False)
    meta.setup_commit_pass(view, COUNTS, HOST[:3], start_positions=STARTS,
                           device_block_table=torch.as_tensor(HOST[:3] + 100))
    assert torch.equal(view.mha_block_table[:3], torch.as_tensor(HOST[:3]))


def test_a_declared_split_takes_the_active_rows_of_a_whole_device_table():
    """With ``set_request_rows(2, 5)`` a whole ``[R, W]`` device table gives rows
    2..4, as the whole host table does."""
    meta, view = _meta()
    device = torch.as_tensor(HOST + 100)
    meta.set_request_rows(2, 5)
    meta.setup_commit_pass(view, COUNTS, HOST, start_positions=STARTS,
                           device_block_table=device)
    assert torch.equal(view.mha_block_table[:3], device[2:5])
    ref, ref_view = make_reference(), make_views(meta)[1]
    ref.setup_commit_pass(ref_view, COUNTS, HOST[2:5], start_positions=STARTS)
    assert torch.equal(view.token_to_block_idx, ref_view.token_to_block_idx)


def test_block_counts_are_checked_and_the_rows_placed_as_they_are():
    """``block_counts`` beside a device copy: a token past its count is still refused;
    within the counts the rows are the device copy's, -1 entries included."""
    meta, view = _meta()
    host = HOST[:3].copy()
    host[0, 2:] = -1
    device = torch.as_tensor(host)
    counts_ok = np.array([2, 3, 3], dtype=np.int32)
    with pytest.raises(ValueError, match="block_counts"):
        meta.setup_commit_pass(view, COUNTS, host, start_positions=STARTS,
                               block_counts=counts_ok - 1, device_block_table=device)
    meta.setup_commit_pass(view, COUNTS, host, start_positions=STARTS,
                           block_counts=counts_ok, device_block_table=device)
    assert torch.equal(view.mha_block_table[:3], device)


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(3, W, dtype=torch.float32), "expected a 2-D integer tensor"),
    (torch.zeros(3 * W, dtype=torch.int32), "expected a 2-D integer tensor"),
    (np.zeros((3, W), dtype=np.int32), "expected a 2-D integer tensor"),
    (torch.zeros(2, W, dtype=torch.int32), r"shape \(2, 6\), expected \[>= 3, 6\]"),
    (torch.zeros(3, W + 1, dtype=torch.int32), r"shape \(3, 7\), expected \[>= 3, 6\]"),
    (torch.zeros(3, W, dtype=torch.int32, device="meta"), "on meta, not the persistent"),
], ids=["float", "1-D", "numpy", "rows", "width", "device"])
def test_a_bad_device_table_is_refused_before_anything_is_written(bad, message):
    """The error names ``device_block_table`` and its bound; no view field, buffer or
    scalar state changed."""
    meta, view = _meta()
    before = {**buffer_state(meta), **view_state(view)}
    with pytest.raises(ValueError, match="device_block_table: " + message):
        meta.setup_commit_pass(view, COUNTS, HOST[:3], start_positions=STARTS,
                               device_block_table=bad)
    assert_same_state(before, {**buffer_state(meta), **view_state(view)})


def test_mixed_calls_with_and_without_device_rows_keep_the_reference_bytes():
    """Device-row passes between host-row passes and draft loops (the begin's reused
    rows are dropped by a device-row pass, never taken stale)."""
    meta, view = _meta()
    ref = make_reference()
    ref_view = make_views(meta)[1]
    rng = np.random.default_rng(5)
    for step in range(6):
        table = rng.permutation(R * W).astype(np.int32).reshape(R, W)[:4]
        starts = rng.integers(0, 8, 4).astype(np.int32)
        counts = rng.integers(0, 4, 4).astype(np.int32)
        device = torch.as_tensor(table) if step % 2 else None
        meta.setup_commit_pass(view, counts, table, start_positions=starts,
                               device_block_table=device)
        ref.setup_commit_pass(ref_view, counts, table, start_positions=starts)
        assert_views_equal(view, ref_view)
        for obj, target in ((meta, view), (ref, ref_view)):
            obj.end_forward()
            obj.begin_decode(4, 4, starts + counts, table, False)
            obj.setup_decode_step(target)
            obj.end_forward()
        assert_views_equal(view, ref_view)
        assert_buffers_equal(meta, ref)


def test_a_landing_narrower_than_the_view_ships_the_host_rows():
    """``block_table_dtype`` int16 under an int32 view: an id past 32767 would wrap in
    the int16 landing the device rows pass through, so the host rows are shipped (the
    device copy, unlike them on purpose here, is not read)."""
    meta = MTPMetadata(**config(block_table_dtype=torch.int16))
    meta.allocate("cpu", mirror=True)
    view, _ = make_views(meta)
    assert view.mha_block_table.dtype == torch.int32
    host = HOST[:3] + 40000
    meta.setup_commit_pass(view, COUNTS, host, start_positions=STARTS,
                           device_block_table=torch.as_tensor(host + 100))
    assert torch.equal(view.mha_block_table[:3], torch.as_tensor(host))


@pytest.mark.cuda_sim
@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG's checks synchronize the simulated device")
def test_a_device_copy_made_on_another_stream_may_be_freed_at_once(make_sim):
    """Under the CUDA simulator: the producer makes the device copy on its own stream
    and frees it right after the call (the caching allocator may hand its memory to
    the producer's next allocation); the queued copy must be covered by
    ``record_stream`` and the rows must still arrive."""
    sim = make_sim(7, idle=1.0)
    with sim:
        meta, _, [(view, _)] = sim_pair(sim)
        producer = sim.Stream("producer")
        device = upload(sim, HOST[:3] + 100, stream=producer)
        sim.synchronize()
        before = sim.record_streams
        meta.setup_commit_pass(view, torch.as_tensor(COUNTS), torch.as_tensor(HOST[:3]),
                               start_positions=torch.as_tensor(STARTS),
                               device_block_table=device)
        sim.free(device)
        assert sim.unsafe_frees == [], sim.unsafe_frees
        assert sim.record_streams > before
        rows = view.mha_block_table[:3].clone()
        sim.synchronize()
        assert torch.equal(sim.peek(rows), torch.as_tensor(HOST[:3] + 100))


@pytest.mark.cuda_sim
@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG's checks read the view back")
def test_the_table_bytes_never_cross_to_the_device(make_sim):
    """Under CUDA semantics (simulated): with the device copy, a commit pass ships the
    same host-to-device bytes at W = 8 and W = 512 (token and length fields only), makes
    no sync, and its table rows arrive; without it the bytes grow with the width."""
    shipped = {}
    for width in (8, 512):
        for with_rows in (True, False):
            sim = make_sim(3, idle=1.0)
            with sim:
                meta = MTPMetadata(**config(max_kv_block_count=width))
                meta.allocate("cpu", mirror=True)
                view = ContextGPUView(R, 64, width)
                host = np.arange(3 * width, dtype=np.int32).reshape(3, width) % 900
                device = upload(sim, host)
                sim.synchronize()
                before = (sim.h2d_bytes, sim.syncs)
                meta.setup_commit_pass(view, torch.as_tensor(COUNTS), torch.as_tensor(host),
                                       start_positions=torch.as_tensor(STARTS),
                                       device_block_table=device if with_rows else None)
                shipped[width, with_rows] = sim.h2d_bytes - before[0]
                assert sim.syncs == before[1]
                rows = view.mha_block_table[:3].clone()
                sim.synchronize()
                assert torch.equal(sim.peek(rows), torch.as_tensor(host))
    assert shipped[8, True] == shipped[512, True]
    assert shipped[512, False] - shipped[512, True] >= 3 * 512 * 4
