"""Upstream parity (contract §10) and the full-batch pad hazard (contract §6), on both paths.

Launch bounds of empty and graphed forwards, the active slice of the annotations as
``inherited_blocks``, the mirror path's host copy of the draft state, and the block
row of the request that absorbs a full commit batch's pad rows. Every shape and view is
also compared with the pure-torch reference, so the differential suites agree.

Geometry (tests.helpers.config): R = 8, W = 6, BS = 4, D = 999.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings

from mtpmeta import ForwardShape
from tests.helpers import (assert_views_equal, fill_view, make_metadata, make_reference,
                           make_views)

D = 999
R, W, BS = 8, 6, 4
TABLE = np.arange(R * W, dtype=np.int32).reshape(R, W)  # real block ids, never D


def _pair(path, **overrides):
    meta = make_metadata(path, **overrides)
    ref = make_reference(**overrides)
    view, ref_view = make_views(meta)
    return meta, ref, fill_view(view), fill_view(ref_view)


def _both(meta, ref, view, ref_view, method, *args, **kwargs):
    """Call ``method`` on the library and the reference; same result and view."""
    ours = getattr(meta, method)(view, *args, **kwargs)
    theirs = getattr(ref, method)(ref_view, *args, **kwargs)
    assert ours == theirs, f"{method}: {ours} vs reference {theirs}"
    assert_views_equal(view, ref_view)
    return ours


def _blocks_read(view, request):
    """Blocks varlen attention reads for ``request``: KV position j is column j // BS of
    its mha_block_table row, for j < its KV length."""
    length = int(view.mha_kv_seq_lengths[request])
    row = view.mha_block_table[request].tolist()
    return [row[j // BS] for j in range(length)]


# ----------------------------------------------------------------- launch bounds
def test_empty_forwards_report_launch_bounds_of_one(path):
    """A forward with no requests or no tokens launches with max_seqlen 1, as upstream:
    a 0 bound makes some varlen kernels divide by it or skip the launch that writes the
    pad rows."""
    meta, ref, view, ref_view = _pair(path)
    starts = np.zeros(R, dtype=np.int32)
    for padded in (0, 3):
        for m in (meta, ref):
            m.begin_decode(0, padded, starts, TABLE, False)
        shape = _both(meta, ref, view, ref_view, "setup_decode_step")
        assert shape == ForwardShape(0, padded, 0, padded, 1, 1)
        for m in (meta, ref):
            m.end_forward()
    for counts, kwargs, expected in (
            ([], {}, ForwardShape(0, 0, 0, 0, 1, 1)),
            ([0, 0], {}, ForwardShape(0, 0, 2, 2, 1, 1)),
            ([0, 0], {"padded_request_count": 4}, ForwardShape(0, 0, 2, 4, 1, 1))):
        shape = _both(meta, ref, view, ref_view, "setup_commit_pass", counts, TABLE,
                      **kwargs)
        assert shape == expected


def test_graphed_draft_depths_report_the_capture_time_bound(path):
    """A graphed depth replays a kernel captured once; a bound taken from the capture
    step's lengths (1 after begin_decode_for_capture) would make every replay at longer
    lengths read too few keys. So graphed depths report W * BS at every depth; eager
    depths keep the tight maximum."""
    meta, ref, view, ref_view = _pair(path)
    bound = W * BS
    for graphed in (True, False):
        for m in (meta, ref):
            m.begin_decode(2, 4, np.array([5, 11]), TABLE, graphed)
        for depth in range(3):
            shape = _both(meta, ref, view, ref_view, "setup_decode_step")
            assert (shape.max_seqlen_q, shape.max_seqlen_k) == \
                (1, bound if graphed else 12 + depth)
            for m in (meta, ref):
                m.advance_decode_step()
        for m in (meta, ref):
            m.end_forward()
    for padded in (3, 0):  # the capture warm-up, with and without slots
        for m in (meta, ref):
            m.begin_decode_for_capture(padded)
        shape = _both(meta, ref, view, ref_view, "setup_decode_step")
        assert (shape.max_seqlen_q, shape.max_seqlen_k) == (1, bound)
        for m in (meta, ref):
            m.end_forward()


# ----------------------------------------------------------- active-slice annotations
def test_inherited_blocks_take_the_active_slice_with_paused_rows(path):
    """Paused rows come first: row 0 is paused (no prefix hit), row 1 is the one active
    request and inherited block 11. Passing the whole annotation array redirects by row
    0's count and rewrites the shared block 11 three times; the active slice
    ``[paused:total]`` sends those tokens to the dummy block."""
    meta, ref, view, ref_view = _pair(path)
    for m in (meta, ref):
        m.request_matched_prefix_blocks[:2] = torch.tensor([0, 1], dtype=torch.int32)
    table = np.array([[11, 12, 13, 14, 15, 16]], dtype=np.int32)
    paused, total = 1, 2
    for inherited, expected in (("whole", [11, 11, 11]), ("active", [D, D, D])):
        for m, v in ((meta, view), (ref, ref_view)):
            annotations = m.request_matched_prefix_blocks
            m.setup_commit_pass(v, [3], table, inherited_blocks=annotations if
                                inherited == "whole" else annotations[paused:total])
            m.end_forward()
        assert view.token_to_block_idx[:3].tolist() == expected, inherited
        assert_views_equal(view, ref_view)


def test_readme_example_declares_the_split_before_passing_whole_arrays():
    """The README's commit-pass example is what engine authors copy; a whole array
    without a declared split redirects the wrong rows as soon as a request is paused.
    The split protects the prefix hit by itself: no ``inherited_blocks`` to forget."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("## One speculative step", 1)[1].split("\n## ", 1)[0]
    declared = example.index("mtp.set_request_rows(paused, total)")
    assert declared < example.index("mtp.setup_commit_pass(")
    assert declared < example.index("mtp.begin_decode(")
    assert "inherited_blocks=" not in example.split("```python", 1)[1].split("```")[0]
    assert "draft_annotation_offset = " not in example


# ------------------------------------------------------- in-place edits of the views
def test_direct_path_reads_in_place_edits_of_the_active_views():
    """Upstream's draft depth reads active_offsets/active_block_table, so a caller's
    in-place edit takes effect there; the direct path keeps that behaviour."""
    meta, ref, view, ref_view = _pair("direct")
    for m in (meta, ref):
        m.begin_decode(2, 2, np.array([5, 11]), TABLE, False)
        m.active_offsets[0] = 8
        m.active_block_table[1, 2] = 42
    shape = _both(meta, ref, view, ref_view, "setup_decode_step")
    assert view.token_to_pos_ids[:2].tolist() == [8, 11]
    assert view.token_to_block_idx[:2].tolist() == [int(TABLE[0, 2]), 42]
    assert shape.max_seqlen_k == 12


def test_mirror_path_eager_depths_ignore_in_place_edits_until_begin_decode():
    """The mirror path stages an eager depth from its host copy of the draft state (a
    read-back of the device buffers would be a sync), so an in-place edit of the active
    views does not reach the view or the shape: the documented difference. Calling
    begin_decode again with the edited values is the supported way, and then both paths
    and the reference agree."""
    meta, ref, view, ref_view = _pair("mirror")
    meta.begin_decode(2, 2, np.array([5, 11]), TABLE, False)
    meta.active_offsets[0] = 8
    meta.active_block_table[1, 2] = 42
    shape = meta.setup_decode_step(view)
    assert view.token_to_pos_ids[:2].tolist() == [5, 11]  # the staged values
    assert view.token_to_block_idx[:2].tolist() == [int(TABLE[0, 1]), int(TABLE[1, 2])]
    assert shape.max_seqlen_k == 12
    # The depth's table rows come from the device table, device-to-device (the table
    # is never re-staged through the host per depth), so they do see the edit.
    assert int(view.mha_block_table[1, 2]) == 42
    meta.end_forward()

    starts, table = np.array([8, 11]), TABLE.copy()
    table[1, 2] = 42
    for m in (meta, ref):
        m.begin_decode(2, 2, starts, table, False)
    _both(meta, ref, view, ref_view, "setup_decode_step")
    assert view.token_to_pos_ids[:2].tolist() == [8, 11]
    assert view.token_to_block_idx[:2].tolist() == [int(TABLE[0, 2]), 42]
    meta.end_forward()

    # A graphed depth stages from the same host copy (contract §9), so it ignores the edit
    # too: the mirror path behaves one way for every depth.
    meta.begin_decode(2, 2, np.array([5, 11]), TABLE, True)
    meta.active_offsets[0] = 8
    meta.setup_decode_step(view)
    assert view.token_to_pos_ids[:2].tolist() == [5, 11]


# ---------------------------------------------------------- full-batch pad absorption
def test_full_batch_pad_request_reads_no_block_it_was_not_given(path):
    """The issue's repro: R = 2, each request owns one block, counts [3, 3] padded to 8.
    Request 1 absorbs the 2 pad rows (KV length 5) and, with the caller's row copied,
    read blocks [1, 1, 1, 1, -1]: an out-of-bounds read on a GPU. Its columns past the
    span it writes now point at the dummy block."""
    geometry = dict(max_requests=2, max_kv_block_count=4)
    meta, ref, view, ref_view = _pair(path, **geometry)
    table = [[0, -1, -1, -1], [1, -1, -1, -1]]
    shape = _both(meta, ref, view, ref_view, "setup_commit_pass", [3, 3], table,
                  padded_token_count=8)
    assert shape == ForwardShape(6, 8, 2, 2, 5, 5)
    assert view.mha_kv_seq_lengths.tolist() == [3, 5]
    assert _blocks_read(view, 0) == [0, 0, 0]
    assert _blocks_read(view, 1) == [1, 1, 1, 1, D]
    assert view.mha_block_table.tolist() == [[0, -1, -1, -1], [1, D, D, D]]


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_full_batch_pad_request_columns_past_its_span_read_the_dummy(path, data):
    """P == R with pad rows, random spans: the absorbing request's columns wholly at or
    past its span's end are D, every other entry is the caller's, so a caller whose
    table is -1 past each span makes no request read a -1."""
    n_req = data.draw(st.integers(1, 4), label="R")
    meta, ref, view, ref_view = _pair(path, max_requests=n_req)
    span = W * BS
    starts = [data.draw(st.integers(0, span - 1), label="start") for _ in range(n_req)]
    counts = [data.draw(st.integers(0, span - s), label="count") for s in starts]
    pad = data.draw(st.integers(1, 2 * BS), label="pad")
    ends = [s + c for s, c in zip(starts, counts)]
    owned = [-(-e // BS) for e in ends]  # columns holding a position below the end
    table = np.full((n_req, W), -1, dtype=np.int32)
    for r in range(n_req):
        table[r, :owned[r]] = 100 + 10 * r + np.arange(owned[r])
    padded = sum(counts) + pad
    _both(meta, ref, view, ref_view, "setup_commit_pass", counts, table,
          start_positions=starts, padded_token_count=padded)
    rows = view.mha_block_table[:n_req].tolist()
    last = n_req - 1
    assert rows[:last] == table[:last].tolist()
    assert rows[last] == table[last, :owned[last]].tolist() + [D] * (W - owned[last])
    assert int(view.mha_kv_seq_lengths[last]) == counts[last] + pad
    assert -1 not in _blocks_read(view, last)
