"""The mirror path's default calls on wide tables (``mtpmeta.mirror.counted``,
"Derived counts"): a begin or commit pass without block counts whose table has at
least ``DERIVED_MIN_ENTRIES`` entries and ``DERIVED_MIN_WIDTH`` columns
(``mtpmeta.mirror.counted.derives``) writes each row only up to its trailing run of -1.

Both read the whole table once (``native.draft_state.used_columns``), then ship
packed rows (``[n, C]`` for a begin, ``[m, C]`` for a commit pass; each row's used
columns, -1 after them) and the device rows get -1 past ``C`` (``D`` for a commit
pass's pad request). The contract is unchanged: the view, the ForwardShape and every buffer equal
the reference's on the raw table after every depth and pass, and a depth or pass that
writes a -1 block is refused with the very message of a whole-row call, nothing
changed. The oracle tests force the route on small tables (both thresholds 0,
``_route``), with two staging slots so a slot's known rows are reused within a few
calls, and compare refusals with a whole-row object. Rows without a -1 tail take the
route too (``C = W``): their read is done, so nothing falls back to a second read.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtpmeta.mirror.counted
from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.counters import OpCounter
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from tests.test_block_counts import step_inputs
from tests.helpers import (assert_buffers_equal, assert_same_state, assert_views_equal,
                           buffer_state, config, view_state)

R, BS, TOKENS = 8, 4, 64


def _route(monkeypatch, derived: bool) -> None:
    """Force the derived route on (both thresholds 0) or off, for the next calls."""
    for name in ("DERIVED_MIN_ENTRIES", "DERIVED_MIN_WIDTH"):
        monkeypatch.setattr(mtpmeta.mirror.counted, name, 0 if derived else 1 << 30)


def _pair(width: int, dtype: torch.dtype):
    kwargs = config(max_requests=R, max_kv_block_count=width, block_size_tokens=BS,
                    block_table_dtype=dtype)
    meta = MTPMetadata(**kwargs)
    # 2 slots: a slot's packed rows are rewritten within a few calls (its known rows)
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS, staging_slots=2)
    ref = ReferenceMTPMetadata(**kwargs)
    ref.allocate("cpu")
    return (meta, ContextGPUView(R, TOKENS, width, "cpu"), ref,
            ReferenceGPUView(R, TOKENS, width, "cpu"))


def _table(rng: np.random.Generator, width: int, used: np.ndarray) -> np.ndarray:
    """Real blocks before ``used[i]``, -1 after; some -1 holes inside; now and then a
    row whose last column is real (no -1 tail: every column used)."""
    table = rng.permutation(R * width).reshape(R, width).astype(np.int32)
    for i in range(R):
        table[i, int(used[i]):] = -1
        if used[i] > 1 and rng.random() < 0.3:
            table[i, int(rng.integers(0, used[i] - 1))] = -1
    if rng.random() < 0.15:
        table[int(rng.integers(0, R)), width - 1] = 7
    return table


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@settings(max_examples=40, deadline=None,  # monkeypatch is only set, never relied on reset
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 5))
def test_packed_begins_equal_the_reference_on_the_raw_table(dtype, seed, steps,
                                                           monkeypatch):
    """Begins (by used columns, all of them for a row without a -1 tail), depths, advances and
    commit passes on the begin's table: the view, the ForwardShape and every buffer
    equal the reference's after each call; where a whole-row begin's depth is refused
    (a -1 block written), the packed one is refused with the same message, nothing
    changed."""
    rng = np.random.default_rng(seed)
    width = int(rng.choice([6, 40]))
    meta, view, ref, ref_view = _pair(width, dtype)
    whole, whole_view, _, _ = _pair(width, dtype)
    t = torch.from_numpy
    for _ in range(steps):
        n = int(rng.integers(0, R + 1))
        padded = int(rng.integers(n, R + 1))
        used = rng.integers(0, min(width, 12) + 1, size=R)
        table = _table(rng, width, used)
        starts = (rng.integers(0, np.maximum(used, 1) * BS) - rng.integers(0, 3, size=R))
        starts = np.maximum(starts, 0).astype(np.int32)
        for obj, derived in ((meta, True), (whole, False)):
            _route(monkeypatch, derived)
            obj.begin_decode(n, padded, t(starts), t(table), False)
        ref.begin_decode(n, padded, t(starts), t(table), False)
        assert meta._backend.begin_derived and not whole._backend.begin_derived
        for _ in range(3):
            try:
                whole.setup_decode_step(whole_view)
            except ValueError as error:
                before, view_before = buffer_state(meta), view_state(view)
                with pytest.raises(ValueError) as ours:
                    meta.setup_decode_step(view)
                assert str(ours.value) == str(error)
                assert_same_state(before, buffer_state(meta))
                assert_same_state(view_before, view_state(view))
                break
            theirs = ref.setup_decode_step(ref_view)
            ours = meta.setup_decode_step(view)
            assert (ours.max_seqlen_q, ours.max_seqlen_k) == \
                (theirs.max_seqlen_q, theirs.max_seqlen_k)
            assert_views_equal(view, ref_view)
            for obj in (meta, whole, ref):
                obj.advance_decode_step()
        for obj in (meta, whole, ref):
            obj.end_forward()
        assert_buffers_equal(meta, ref)
        zeros = np.zeros(n, np.int32)  # a pass over the same rows: nothing to reuse
        kwargs = dict(start_positions=t(zeros), padded_request_count=n)
        meta.setup_commit_pass(view, t(zeros), t(table), **kwargs)
        ref.setup_commit_pass(ref_view, t(zeros), t(table), **kwargs)
        assert_views_equal(view, ref_view)
        meta.end_forward()
        ref.end_forward()
        assert_buffers_equal(meta, ref)


def _wide(width: int = 64):
    """R 8, W ``width``: rows use at most 3 columns (C 8), row 1's column 2 is -1."""
    meta, view, _, _ = _pair(width, torch.int32)
    table = np.full((R, width), -1, np.int32)
    table[:, :3] = np.arange(R * 3, dtype=np.int32).reshape(R, 3)
    table[1, 2] = -1
    return meta, view, table


@pytest.mark.parametrize("column, row", [(2, 1), (5, 0), (20, 0)],
                         ids=["hole", "past-used", "past-C"])
def test_a_depth_on_a_minus_one_column_is_refused_as_on_whole_rows(column, row,
                                                                  monkeypatch):
    """Row ``row``'s depth writes column ``column`` (-1 in the caller's table: a hole,
    past its used columns, past the C = 8 shipped ones): the packed begin refuses it
    with the message of a whole-row begin, naming the same row, nothing changed."""
    messages = []
    for derived in (True, False):  # packed, then whole rows
        _route(monkeypatch, derived)
        meta, view, table = _wide()
        starts = np.zeros(R, np.int32)
        starts[row] = column * BS
        meta.begin_decode(3, 4, starts, table, False)
        assert meta._backend.begin_derived == derived
        before, view_before = buffer_state(meta), view_state(view)
        with pytest.raises(ValueError) as error:
            meta.setup_decode_step(view)
        assert_same_state(before, buffer_state(meta))
        assert_same_state(view_before, view_state(view))
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert f"row {row}" in messages[0] and "block_counts" not in messages[0]


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: the checks issue ops of their own")
def test_wide_calls_pack_at_the_default_threshold_within_their_op_budgets():
    """R 64, W 2048 (n W >= DERIVED_MIN_ENTRIES): the begin's host truth is the packed
    ``[n, C]`` rows of the caller's table (C the bucket of the most columns a row uses,
    -1 past each row's), and the device rows are the caller's whole rows; a begin costs
    4 device data ops (head, packed rows, their placement, -1 past C), a commit pass 3
    (packed rows, their placement, whole rows of -1), within its budget of 4; at C = W
    2 each (the rows land whole); no read-back and no new storage."""
    rows, width = 64, 2048
    kwargs = config(max_requests=rows, max_kv_block_count=width, block_size_tokens=BS)
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
    view = ContextGPUView(rows, TOKENS, width, "cpu")
    ref = ReferenceMTPMetadata(**kwargs)
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(rows, TOKENS, width, "cpu")
    table = np.full((rows, width), -1, np.int32)
    table[:, :5] = np.arange(rows * 5, dtype=np.int32).reshape(rows, 5)
    starts = np.zeros(rows, np.int32)
    n = 40
    assert mtpmeta.mirror.counted.derives(n * width, width)
    for round_ in range(3):
        table[:, 5] = -1 if round_ % 2 else 3  # the bucket stays 8 columns
        with OpCounter() as counter:
            meta.begin_decode(n, n, starts, table, False)
        if round_:
            assert counter.data_ops == 4, counter.ops
            assert counter.scalar_reads == 0 and counter.new_storages == 0, counter.ops
        backend = meta._backend
        assert backend.begin_derived
        assert backend.host_block_table.shape == (n, 8)  # bucket of 6 used columns
        assert np.array_equal(backend.host_block_table, table[:n, :8])
        assert np.array_equal(meta.block_table[:n].numpy(), table[:n])
        meta.end_forward()
        spans = np.ones(n, np.int32)
        with OpCounter() as counter:
            meta.setup_commit_pass(view, spans, table, start_positions=starts[:n])
        if round_:
            assert counter.data_ops == 3, counter.ops
            assert counter.scalar_reads == 0 and counter.new_storages == 0, counter.ops
        t = torch.from_numpy
        ref.setup_commit_pass(ref_view, t(spans), t(table), start_positions=t(starts[:n]))
        assert_views_equal(view, ref_view)
        meta.end_forward()
        ref.end_forward()
        assert meta._backend.reused_table_rows == 0  # packed: no row compared or reused
    table[0, width - 1] = 5  # a row with no -1 tail: all its columns, read once
    with OpCounter() as counter:
        meta.begin_decode(n, n, starts, table, False)
    assert counter.data_ops == 2, counter.ops  # C = W: the rows land in place
    assert meta._backend.begin_derived
    assert np.array_equal(meta._backend.host_block_table, table[:n])
    assert np.array_equal(meta.block_table[:n].numpy(), table[:n])
    meta.end_forward()
    with OpCounter() as counter:  # C = W: whole rows ship with the pass, nothing reused
        meta.setup_commit_pass(view, spans, table, start_positions=starts[:n])
    assert counter.data_ops == 2, counter.ops
    ref.setup_commit_pass(ref_view, torch.from_numpy(spans), torch.from_numpy(table),
                          start_positions=torch.from_numpy(starts[:n]))
    assert_views_equal(view, ref_view)
    assert meta._backend.reused_table_rows == 0


@pytest.mark.parametrize("rows, width, derived", [(600, 128, False), (300, 256, True)],
                         ids=["narrow", "wide"])
def test_the_default_route_needs_both_thresholds(rows, width, derived):
    """``n W >= DERIVED_MIN_ENTRIES`` on a table narrower than ``DERIVED_MIN_WIDTH``
    takes whole rows (measured as fast there); at the width it takes the used columns."""
    kwargs = config(max_requests=rows, max_kv_block_count=width, block_size_tokens=BS)
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
    n = rows - 40
    assert n * width >= mtpmeta.mirror.counted.DERIVED_MIN_ENTRIES
    assert (width >= mtpmeta.mirror.counted.DERIVED_MIN_WIDTH) == derived
    table = np.full((rows, width), -1, np.int32)
    table[:, :3] = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
    meta.begin_decode(n, n, np.zeros(rows, np.int32), table, False)
    assert meta._backend.begin_derived == derived
    assert np.array_equal(meta.block_table[:n].numpy(), table[:n])


@pytest.mark.parametrize("width", [6, 40])
@settings(max_examples=60, deadline=None,  # monkeypatch is only set, never relied on reset
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), passes=st.integers(1, 6))
def test_packed_commit_passes_equal_the_reference_on_the_raw_table(width, seed, passes,
                                                                  monkeypatch):
    """Commit passes (spans, starts, inherited blocks, pad tokens and requests, full
    batches whose last request absorbs the pad) on raw tables with -1 past each row's
    blocks: the view and every buffer equal the reference's; where a whole-row pass is
    refused, the packed one is refused with the same message, nothing changed."""
    rng = np.random.default_rng(seed)
    meta, view, ref, ref_view = _pair(width, torch.int32)
    whole, whole_view, _, _ = _pair(width, torch.int32)
    t = torch.from_numpy
    for _ in range(passes):
        _, commit = step_inputs(rng, 1, width)
        spans, starts, table, _, inherited, padded_tokens, padded_requests = commit
        if rng.random() < 0.2:  # a full batch with pad tokens: the whole-row route
            spans, starts = np.ones(R, np.int32), np.zeros(R, np.int32)
            inherited = np.zeros(R, np.int32)
            table[:, 0] = np.arange(R, dtype=np.int32)
            padded_tokens, padded_requests = R + 3, R
        if rng.random() < 0.2:  # a row without a -1 tail: packed at C = W
            table[int(rng.integers(0, R)), width - 1] = 5
        kwargs = dict(start_positions=t(starts), inherited_blocks=t(inherited),
                      padded_token_count=padded_tokens,
                      padded_request_count=padded_requests)
        _route(monkeypatch, False)
        try:
            whole.setup_commit_pass(whole_view, t(spans), t(table), **kwargs)
        except ValueError as error:
            _route(monkeypatch, True)
            before, view_before = buffer_state(meta), view_state(view)
            with pytest.raises(ValueError) as ours:
                meta.setup_commit_pass(view, t(spans), t(table), **kwargs)
            assert str(ours.value) == str(error)
            assert_same_state(before, buffer_state(meta))
            assert_same_state(view_before, view_state(view))
            continue
        whole.end_forward()
        _route(monkeypatch, True)
        ours = meta.setup_commit_pass(view, t(spans), t(table), **kwargs)
        theirs = ref.setup_commit_pass(ref_view, t(spans), t(table), **kwargs)
        assert ours.max_seqlen_q == max(theirs.max_seqlen_q, 1)
        assert_views_equal(view, ref_view)
        meta.end_forward()
        ref.end_forward()
        assert_buffers_equal(meta, ref)


def test_counted_and_packed_calls_never_take_each_others_slot_rows(monkeypatch):
    """Two staging slots; a begin and a commit pass with block counts (``D`` past the
    counts), then on the same slots packed ones at the same ``C`` (-1 past them): the
    slot's rows written under one fill are never taken as known under the other, so
    the device table and the view hold -1, not ``D``, past each row's blocks."""
    _route(monkeypatch, True)
    width, n = 40, 6
    meta, view, ref, ref_view = _pair(width, torch.int32)
    table = np.full((R, width), -1, np.int32)
    table[:, :2] = np.arange(R * 2, dtype=np.int32).reshape(R, 2)
    counts = np.full(R, 2, np.int32)
    starts = np.zeros(R, np.int32)
    spans = np.ones(n, np.int32)
    for counted in (True, True, False, False):  # slots 0, 1, then 0, 1 again
        extra = {"block_counts": counts} if counted else {}
        meta.begin_decode(n, n, starts, table, False, **extra)
        assert meta._backend.begin_derived != counted
        expected = table[:n].copy()
        if counted:
            expected[:, 2:] = meta.dummy_block_idx
        assert np.array_equal(meta.block_table[:n].numpy(), expected)
        meta.end_forward()
        meta.setup_commit_pass(view, spans, table, start_positions=starts[:n], **extra)
        meta.end_forward()
    ref.setup_commit_pass(ref_view, torch.from_numpy(spans), torch.from_numpy(table),
                          start_positions=torch.from_numpy(starts[:n]))
    assert_views_equal(view, ref_view)

