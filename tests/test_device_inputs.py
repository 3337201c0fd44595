"""Device-tensor inputs on the mirror path.

Upstream call sites pass some inputs already on the device; the mirror path then uses
device ops instead of host staging. On a CPU-only machine a CPU tensor is "on the
device" of a CPU-forced mirror object, so these tests route every torch tensor input
to the device-op code (by patching the router's predicate) and compare the results with
the reference. Failure story: the device-op route drifts from the host route, or sends
a bad column to a real block, and only GPU users see it.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtpmeta import ContextGPUView
from mtpmeta.bench.counters import OpCounter
from mtpmeta.reference import ReferenceGPUView

from tests.helpers import (assert_buffers_equal, assert_views_equal, make_metadata,
                           make_reference, make_views, namespace_view)


def _pair():
    meta = make_metadata("mirror")
    ref = make_reference()
    view, ref_view = make_views(meta, max_tokens=64)
    return meta, ref, view, ref_view


def _table(rng, meta, dtype=torch.int32):
    return torch.tensor(rng.integers(0, 500, (meta.max_requests, meta.max_kv_block_count)),
                        dtype=dtype)


@pytest.mark.parametrize("with_inherited", [False, True])
def test_device_token_maps_match_reference(device_route, rng, with_inherited):
    meta, ref, view, ref_view = _pair()
    limit = meta.max_kv_block_count * meta.block_size_tokens
    for _ in range(20):
        T = int(rng.integers(0, 20))
        rows = torch.tensor(rng.integers(0, meta.max_requests, T), dtype=torch.int64)
        positions = torch.tensor(rng.integers(0, limit, T), dtype=torch.int32)
        table = _table(rng, meta)
        inherited = torch.tensor(rng.integers(0, 4, meta.max_requests), dtype=torch.int32) \
            if with_inherited else None
        padded = T + int(rng.integers(0, 8))
        meta.write_token_maps(view, rows, positions, table, padded, inherited)
        ref.write_token_maps(ref_view, rows, positions, table, padded, inherited)
        assert_views_equal(view, ref_view)


@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_device_token_maps_match_reference_in_every_input_dtype(
        device_route, rng, rows_dtype, positions_dtype, table_dtype):
    """The device route's scratch is typed per input dtype (its row clamp writes only the
    rows' dtype; a table unlike the view's block dtype gathers into its own scratch):
    every mix writes the reference's view, with and without inherited blocks (columns
    outside the table, which the reference cannot index, are the next test's)."""
    meta, ref, view, ref_view = _pair()
    limit = meta.max_kv_block_count * meta.block_size_tokens
    for step in range(12):
        T = int(rng.integers(1, 20))
        rows = torch.tensor(rng.integers(0, meta.max_requests, T), dtype=rows_dtype)
        positions = torch.tensor(rng.integers(0, limit, T), dtype=positions_dtype)
        table = _table(rng, meta, table_dtype)
        inherited = torch.tensor(rng.integers(0, 4, meta.max_requests), dtype=torch.int32) \
            if step % 2 else None
        padded = T + int(rng.integers(0, 8))
        meta.write_token_maps(view, rows, positions, table, padded, inherited)
        ref.write_token_maps(ref_view, rows, positions, table, padded, inherited)
        assert_views_equal(view, ref_view)


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: the invariant checks issue torch ops")
@pytest.mark.parametrize("table_dtype, ops", [(torch.int32, 12), (torch.int64, 13)])
def test_device_token_maps_allocate_nothing_after_the_first_call(device_route, rng,
                                                                 table_dtype, ops):
    """The drop-in's draft loop calls write_token_maps at every depth: after the view's
    first call it writes through the view's fixed scratch (no new storage, no read-back)
    in 12 device data ops with int64 rows (one more copy for a table unlike the view's
    block dtype)."""
    meta, _, view, _ = _pair()
    limit = meta.max_kv_block_count * meta.block_size_tokens
    counters = []
    for _ in range(3):
        T = int(rng.integers(4, 20))
        rows = torch.tensor(rng.integers(0, meta.max_requests, T))
        positions = torch.tensor(rng.integers(0, limit, T), dtype=torch.int32)
        table = _table(rng, meta, table_dtype)
        with OpCounter() as counter:
            meta.write_token_maps(view, rows, positions, table, T)
        counters.append(counter)
    assert all(c.scalar_reads == 0 for c in counters)
    assert [c.new_storages for c in counters[1:]] == [0, 0], [c.ops for c in counters]
    assert [c.data_ops for c in counters[1:]] == [ops] * 2, [c.ops for c in counters]


def _inherited_calls(rng, meta, inherited_dtype):
    """Three device-route ``write_token_maps`` inputs with ``inherited_blocks`` (``[R]`` of
    ``inherited_dtype``, counts in ``[0, 4)``): ``(rows, positions, table, inherited,
    padded)``, fresh tensors each call as a caller passes them."""
    limit = meta.max_kv_block_count * meta.block_size_tokens
    for _ in range(3):
        T = int(rng.integers(4, 20))
        yield (torch.tensor(rng.integers(0, meta.max_requests, T)),
               torch.tensor(rng.integers(0, limit, T), dtype=torch.int32),
               _table(rng, meta),
               torch.tensor(rng.integers(0, 4, meta.max_requests), dtype=inherited_dtype),
               T + int(rng.integers(0, 4)))


@pytest.mark.parametrize("inherited_dtype", [torch.int32, torch.int64])
def test_device_route_keeps_inherited_blocks_in_fixed_scratch(device_route, rng,
                                                              inherited_dtype):
    """The device route of ``write_token_maps`` with ``inherited_blocks``, and the copy
    of them its record keeps (``DeviceRoute.keep_inherited``): after the view's first
    call no new storage and no read-back, the view equals the reference's, the kept
    copy holds the call's counts and keeps them when the caller then changes its
    tensor. An ``inherited_blocks`` longer than ``R`` is kept by a copy of its own."""
    meta, ref, view, ref_view = _pair()
    route, target = meta._backend.device_route, meta._target(view)
    counters = []
    for rows, positions, table, inherited, padded in _inherited_calls(rng, meta,
                                                                      inherited_dtype):
        with OpCounter() as counter:
            route.write_token_maps(target, rows, positions, table, inherited, padded)
            kept = route.keep_inherited(target, inherited)
        counters.append(counter)
        ref.write_token_maps(ref_view, rows, positions, table, padded, inherited)
        assert_views_equal(view, ref_view)
        want = inherited.clone()
        inherited.add_(7)  # the caller reuses its tensor
        assert torch.equal(kept, want) and kept.dtype == inherited_dtype
    assert all(c.scalar_reads == 0 for c in counters)
    assert [c.new_storages for c in counters[1:]] == [0, 0], \
        [c.new_storage_ops for c in counters]
    longer = torch.arange(meta.max_requests + 3, dtype=inherited_dtype)
    kept = route.keep_inherited(target, longer)
    assert torch.equal(kept, longer) and kept.data_ptr() != longer.data_ptr()
    assert route.keep_inherited(target, None) is None


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: the invariant checks issue torch ops")
def test_device_token_maps_with_inherited_blocks_allocate_nothing_after_the_first_call(
        device_route, rng):
    """``write_token_maps`` with device ``inherited_blocks`` may be captured like the
    rest of the device route: after the view's first call no call allocates (the
    record ``check_invariants`` reads included), the view equals the reference's and
    the record keeps the call's counts after the caller changes its tensor."""
    meta, ref, view, ref_view = _pair()
    counters = []
    for rows, positions, table, inherited, padded in _inherited_calls(rng, meta,
                                                                      torch.int32):
        with OpCounter() as counter:
            meta.write_token_maps(view, rows, positions, table, padded, inherited)
        counters.append(counter)
        ref.write_token_maps(ref_view, rows, positions, table, padded, inherited)
        assert_views_equal(view, ref_view)
        want = inherited.clone()
        inherited.add_(7)
        assert torch.equal(meta.last_forward.inherited, want)
        meta.check_invariants(view)
    assert [c.new_storages for c in counters[1:]] == [0, 0], \
        [c.new_storage_ops for c in counters]


def test_device_token_maps_send_out_of_table_columns_to_the_dummy_block(device_route):
    """Device values cannot be checked without a sync; a column beyond the table must
    then land in the dummy block, never in a real block of another column."""
    meta, _, view, _ = _pair()
    table = torch.arange(meta.max_requests * meta.max_kv_block_count,
                         dtype=torch.int32).view(meta.max_requests, -1)
    too_far = meta.max_kv_block_count * meta.block_size_tokens + 1
    meta.write_token_maps(view, torch.tensor([0, 1]), torch.tensor([too_far, -3]), table, 2)
    assert view.token_to_block_idx[:2].tolist() == [meta.dummy_block_idx] * 2


def test_device_mha_metadata_matches_reference(device_route, rng):
    """Lengths of either dtype, 0..R requests, and past R on a view with more request
    slots than R (the row scan's scratch is the view's own, sized by it); a view with
    int64 MHA length fields takes the two 1-D scans."""
    meta, ref, view, ref_view = _pair()
    for _ in range(30):
        n = int(rng.integers(0, meta.max_requests + 1))
        dtype = torch.int32 if rng.integers(0, 2) else torch.int64
        q = torch.tensor(rng.integers(0, 9, n), dtype=dtype)
        kv = q if rng.integers(0, 2) else torch.tensor(rng.integers(0, 30, n),
                                                       dtype=dtype)
        rows = int(rng.integers(0, n + 1))
        table = _table(rng, meta)[:rows]
        padded = int(rng.integers(n, meta.max_requests + 1))
        meta.write_mha_metadata(view, q, kv, table, padded)
        ref.write_mha_metadata(ref_view, q, kv, table, padded)
        assert_views_equal(view, ref_view)
    wide = ContextGPUView(meta.max_requests + 4, 64, meta.max_kv_block_count)
    ref_wide = ReferenceGPUView(meta.max_requests + 4, 64, meta.max_kv_block_count, "cpu")
    n = meta.max_requests + 3
    q = torch.tensor(rng.integers(0, 9, n), dtype=torch.int32)
    kv = torch.tensor(rng.integers(0, 30, n), dtype=torch.int32)
    table = _table(rng, meta)
    meta.write_mha_metadata(wide, q, kv, table, n + 1)
    ref.write_mha_metadata(ref_wide, q, kv, table, n + 1)
    assert_views_equal(wide, ref_wide)
    long_lengths, ref_long = (namespace_view(meta.max_requests, 64, meta.max_kv_block_count)
                              for _ in range(2))
    for view_ in (long_lengths, ref_long):
        for name in ("mha_query_lengths", "mha_kv_seq_lengths", "mha_cu_query_seq_lengths",
                     "mha_cu_kv_seq_lengths"):
            setattr(view_, name, getattr(view_, name).long())
    n = meta.max_requests
    meta.write_mha_metadata(long_lengths, q[:n], kv[:n], table, n)
    ref.write_mha_metadata(ref_long, q[:n], kv[:n], table, n)
    assert_views_equal(long_lengths, ref_long)


@pytest.mark.parametrize("count,pad", [(3, 0), (3, 5), (8, 5), (0, 2)])
def test_device_prefill_lengths_match_reference(device_route, rng, count, pad):
    meta, ref, _, _ = _pair()
    counts = torch.tensor(rng.integers(0, 9, count), dtype=torch.int32)
    ours = meta.stage_prefill_lengths(counts, pad)
    theirs = ref.stage_prefill_lengths(counts, pad)
    assert torch.equal(ours, theirs)
    assert_buffers_equal(meta, ref)


@pytest.mark.parametrize("graphed", [False, True])
def test_device_begin_decode_runs_the_draft_loop_on_device_ops(device_route, rng, graphed):
    """start_positions on the device: the host has no offsets copy, so the depth is
    computed by device ops; ForwardShape.max_seqlen_k is None for an eager depth (the
    maximum would cost a sync) and the capture-time bound W * BS for a graphed one."""
    meta, ref, view, ref_view = _pair()
    n, padded = 5, 7
    starts = torch.tensor(rng.integers(0, 12, meta.max_requests), dtype=torch.int32)
    table = _table(rng, meta)
    meta.begin_decode(n, padded, starts, table, graphed)
    ref.begin_decode(n, padded, starts, table, graphed)
    assert_buffers_equal(meta, ref)
    for _ in range(3):
        shape = meta.setup_decode_step(view)
        expected = ref.setup_decode_step(ref_view)
        bound = meta.max_kv_block_count * meta.block_size_tokens
        assert shape.max_seqlen_k == (bound if graphed else None)
        assert shape.max_seqlen_q == expected.max_seqlen_q == 1
        assert (shape.token_count, shape.padded_token_count) == \
            (expected.token_count, expected.padded_token_count)
        assert_views_equal(view, ref_view)
        assert_buffers_equal(meta, ref)
        meta.advance_decode_step()
        ref.advance_decode_step()
    assert torch.equal(starts[:n] + 3, meta.offsets[:n])


def test_device_inputs_on_another_device_are_refused(rng):
    """A tensor on a device other than the buffers' is a clear ValueError."""
    meta, _, view, _ = _pair()
    meta_device = torch.empty(4, device="meta", dtype=torch.int32)
    with pytest.raises(ValueError, match="start_positions"):
        meta.begin_decode(2, 2, meta_device, _table(rng, meta), False)
