"""Plausible scheduler mistakes that must not get through silently.

Each refusal is checked on both paths (direct and CPU-forced mirror) for its type, a
message that names the argument, the value and the bound or dtype, and that not one
element of any persistent buffer, scalar or destination-view field changed. Where the
mistake is the KV-corrupting kind (a wrapped or unallocated block id), a positive
control shows that the same call with a legal id writes what the reference writes.

Geometry (tests.helpers.config): R = 8, W = 6, BS = 4, D = 999, int32 block table.
Views are sentinel-filled (777), 16 token rows, R 8, W 6.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from mtpmeta import ContextGPUView, ForwardModeError, InvariantError, MTPForwardMode, \
    MTPMetadata
from tests.helpers import (assert_same_state, assert_views_equal, buffer_state, config,
                           make_metadata, make_reference, make_view, view_state)

R, W, BS, D = 8, 6, 4, 999
# Real block ids 10..35, never D; int64 so that ids past int32 can be planted.
TABLE = np.array([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25],
                  [30, 31, 32, 33, 34, 35]], dtype=np.int64)


def _with(value, row, column, table=TABLE):
    """A copy of ``table`` with ``[row, column] = value``."""
    changed = table.copy()
    changed[row, column] = value
    return changed


def _refused(meta, views, call, exc, match):
    """``call()`` raises ``exc`` matching ``match`` and changes no buffer, scalar or
    view byte."""
    before = buffer_state(meta), [view_state(v) for v in views]
    with pytest.raises(exc, match=match):
        call()
    assert_same_state(before[0], buffer_state(meta))
    for old, view in zip(before[1], views):
        assert_same_state(old, view_state(view))


def _primed(path, **overrides):
    """An object with annotations, a staged draft loop and a sentinel view written by a
    valid depth, so that a refused call has state it could corrupt."""
    meta = make_metadata(path, **overrides)
    meta.request_matched_prefix_blocks[:3] = torch.tensor([1, 0, 2], dtype=torch.int32)
    view = make_view("context")
    meta.begin_decode(2, 3, [9, 2], TABLE, graphed=False)
    meta.setup_decode_step(view)
    return meta, view


def _upstream_layout_view():
    """A view with upstream's dtypes where they differ: token_to_block_idx int64."""
    view = make_view("context")
    view.token_to_block_idx = torch.full((16,), 777, dtype=torch.int64)
    return view


# ----------------------------------------------------- 1.1 block ids that do not fit
@pytest.mark.parametrize("dtype, dummy, value", [
    (torch.int32, D, 2**40 + 5),  # stored 5 before
    (torch.int32, D, 2**31),  # stored -2147483648 before
    (torch.int8, 99, 300),  # stored 44 before
])
def test_begin_decode_refuses_block_ids_that_do_not_fit_block_table_dtype(
        path, dtype, dummy, value):
    """A table entry that block_table_dtype cannot hold would wrap in the copy into
    ``block_table`` if accepted: the wrapped id is another request's real block."""
    meta, view = _primed(path, block_table_dtype=dtype, dummy_block_idx=dummy)
    table = _with(value, 1, 2)
    _refused(meta, [view], lambda: meta.begin_decode(2, 2, [0, 1], table, False),
             ValueError, rf"block_table_src: block id {value} at \[1, 2\] does not fit "
                         rf"block_table_dtype {dtype}")


def test_begin_decode_accepts_every_id_the_dtype_holds(path):
    """The bound is the dtype's own: int8's 127 and -128 are legal entries (-128 sits
    in a column no token writes)."""
    meta = make_metadata(path, block_table_dtype=torch.int8, dummy_block_idx=99)
    table = _with(-128, 1, 5, _with(127, 0, 0))
    meta.begin_decode(2, 2, [0, 1], table, False)
    assert meta.block_table[:2].tolist() == table[:2].tolist()


def test_draft_depth_refuses_ids_the_view_dtype_cannot_hold(path):
    """``block_table_dtype=torch.int64`` holds ``2**33 + 7``, the view's int32
    token_to_block_idx does not: unchecked, the depth would write 7. Refused before any write,
    for the written column and for any entry of the rows (mha_block_table)."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    meta.begin_decode(2, 2, [0, 5], _with(2**33 + 7, 1, 1), False)  # row 1 writes col 1
    _refused(meta, [view], lambda: meta.setup_decode_step(view), ValueError,
             r"block id 8589934599 at \[1, 1\], written by draft row 1 .* does not fit "
             r"gpu_view.token_to_block_idx dtype torch.int32")
    meta.begin_decode(2, 2, [0, 5], _with(2**33 + 7, 1, 4), False)  # a column not written
    _refused(meta, [view], lambda: meta.setup_decode_step(view), ValueError,
             r"block id 8589934599 at \[1, 4\] does not fit gpu_view.mha_block_table "
             r"dtype torch.int32")


def test_draft_depth_with_wide_ids_into_a_wide_view_writes_them(path):
    """Positive control: a view whose token_to_block_idx and mha_block_table are int64
    holds ``2**33 + 7``, so the same depth writes it, as upstream does (hand-worked:
    row 0 at position 0 reads column 0, row 1 at position 5 column 1)."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    view.token_to_block_idx = torch.zeros(16, dtype=torch.int64)
    view.mha_block_table = torch.zeros((R, W), dtype=torch.int64)
    table = _with(2**33 + 7, 1, 1)
    meta.begin_decode(2, 2, [0, 5], table, False)
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:2].tolist() == [10, 2**33 + 7]
    assert view.mha_block_table[:2].tolist() == table[:2].tolist()


def test_captured_begin_refuses_ids_a_captured_views_dtype_cannot_hold(path):
    """A graph captured with ``capture_setup=True`` replays no host code, so no depth can
    refuse ``2**33 + 7`` for an int32 view at replay: the copy would write 7, another
    request's block. Once a captured depth has run on that view, a later captured
    ``begin_decode`` refuses it (int64 ``block_table_dtype`` holds it), changing
    nothing; an id that fits is still accepted."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    meta.begin_decode_for_capture(3, capture_setup=True)
    meta.setup_decode_step(view)  # the depth a graph would capture
    meta.end_forward()
    _refused(meta, [view], lambda: meta.begin_decode(
        2, 3, [0, 5], _with(2**33 + 7, 1, 4), False, capture_setup=True), ValueError,
        r"block_table_src: block id 8589934599 at \[1, 4\] does not fit the dtype of a "
        r"view a captured depth wrote torch.int32")
    meta.begin_decode(2, 3, [0, 5], _with(2**31 - 1, 1, 4), False, capture_setup=True)
    meta.setup_decode_step(view)
    assert view.mha_block_table[1, 4].item() == 2**31 - 1


def test_captured_depth_refuses_ids_its_view_cannot_hold_before_any_write(path):
    """The first captured depth on a narrower view than its loop's begin checked scans
    that loop's table first: a ValueError before any device op, whatever column holds
    the id."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    meta.begin_decode(2, 3, [0, 5], _with(2**33 + 7, 0, 3), False, capture_setup=True)
    _refused(meta, [view], lambda: meta.setup_decode_step(view), ValueError,
             r"block_table \(the draft loop's, from begin_decode\): block id 8589934599 at "
             r"\[0, 3\] does not fit gpu_view's token_to_block_idx / mha_block_table "
             r"torch.int32")


def test_captured_loop_on_a_wide_view_keeps_wide_ids(path):
    """Positive control: int64 view fields hold ``2**33 + 7``; the captured route
    writes it and a later captured begin accepts it."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    view.token_to_block_idx = torch.zeros(16, dtype=torch.int64)
    view.mha_block_table = torch.zeros((R, W), dtype=torch.int64)
    table = _with(2**33 + 7, 1, 1)
    for _ in range(2):
        meta.begin_decode(2, 3, [0, 5], table, False, capture_setup=True)
        meta.setup_decode_step(view)
        meta.end_forward()
    assert view.token_to_block_idx[:2].tolist() == [10, 2**33 + 7]
    assert view.mha_block_table[:2].tolist() == table[:2].tolist()


@pytest.mark.parametrize("view_kind", ["context", "upstream"])
def test_commit_pass_refuses_block_ids_that_do_not_fit_the_view(path, view_kind):
    """``2**32 + 3`` in a column the pass writes would become
    ``token_to_block_idx = 3`` unchecked. Both view layouts hold an int32 mha_block_table, which
    every entry of a request's row reaches; the written id is named either way."""
    meta, view = _primed(path)
    if view_kind == "upstream":
        view = _upstream_layout_view()
    table = _with(2**32 + 3, 0, 0)
    _refused(meta, [view], lambda: meta.setup_commit_pass(view, [3, 2], table),
             ValueError, r"block_table: block id 4294967299 at \[0, 0\] .*does not fit "
                         r"gpu_view\.(mha_block_table|token_to_block_idx) dtype "
                         r"torch.int32")


def test_writers_refuse_block_ids_that_do_not_fit_the_view(path):
    """write_token_maps checks the block each token writes; write_mha_metadata every
    entry it copies into mha_block_table."""
    meta, view = _primed(path)
    table = _with(2**32 + 3, 0, 1)
    _refused(meta, [view], lambda: meta.write_token_maps(view, [0, 0], [0, 4], table, 3),
             ValueError, r"block_table: block id 4294967299 at \[0, 1\], written by token "
                         r"1 \(position 4\), does not fit gpu_view.token_to_block_idx "
                         r"dtype torch.int32")
    _refused(meta, [view], lambda: meta.write_mha_metadata(view, [1], [5], table[:1], 2),
             ValueError, r"block_table: block id 4294967299 at \[0, 1\] does not fit "
                         r"gpu_view.mha_block_table dtype torch.int32")


def test_write_token_maps_ignores_ids_in_columns_no_token_writes(path):
    """Positive control: only written blocks reach token_to_block_idx, so a wide id in
    another column is accepted and the maps equal the reference's."""
    meta, ref = make_metadata(path), make_reference()
    view, ref_view = make_view("context"), make_view("reference")
    table = _with(2**32 + 3, 0, 5)
    meta.write_token_maps(view, [0, 1], [0, 6], table, 3)
    ref.write_token_maps(ref_view, torch.tensor([0, 1]), torch.tensor([0, 6]),
                         torch.from_numpy(table), 3)
    assert_views_equal(view, ref_view)


def test_check_invariants_flags_a_negative_block_id(path):
    """A wrapped ``2**31`` reads ``-2147483648``: no real token may hold a negative
    block (the writers refuse one; this plants it in the view)."""
    meta, view = _primed(path)
    meta.check_invariants()
    view.token_to_block_idx[1] = -2**31
    with pytest.raises(InvariantError, match=r"block ids: token 1 .* -2147483648"):
        meta.check_invariants()


def test_check_invariants_flags_a_draft_id_the_view_cannot_hold(path):
    """An int64 draft table entry ``2**33 + 7`` read by a real draft token of an int32
    view: the view can only hold a wrapped id (planted, since the depth refuses it)."""
    meta = make_metadata(path, block_table_dtype=torch.int64)
    view = make_view("context")
    meta.begin_decode(2, 2, [0, 5], TABLE, False)
    meta.setup_decode_step(view)
    meta.check_invariants()
    meta.block_table[1, 1] = 2**33 + 7
    view.token_to_block_idx[1] = 7
    with pytest.raises(InvariantError, match=r"block ids: token 1 .* 8589934599 .* "
                                             r"cannot hold"):
        meta.check_invariants()


def test_device_route_begin_decode_wrap_is_flagged_by_check_invariants(device_route):
    """On the device route ids are not value-checked (a sync): a too-wide id wraps in
    the copy, as torch's does. ``check_invariants`` (at the first check after the call;
    under MTPMETA_DEBUG=1 the call's own) compares the buffer with what it was given."""
    meta = make_metadata("mirror")
    with pytest.raises(InvariantError, match=r"block ids: block_table\[1, 2\] = 5, but "
                                             r"begin_decode was given 1099511627781"):
        meta.begin_decode(2, 2, torch.tensor([0, 1]),
                          torch.from_numpy(_with(2**40 + 5, 1, 2)), False)
        meta.check_invariants()


def test_device_route_token_maps_wrap_is_flagged_by_check_invariants(device_route):
    """A device-route write_token_maps with ``2**32 + 3`` writes 3 (unchecked); the
    record keeps the given table and the first check compares the view with it."""
    meta = make_metadata("mirror")
    view = make_view("context")
    with pytest.raises(InvariantError, match=r"block ids: token 1 .* token_to_block_idx "
                                             r"3, but the block_table it was given "
                                             r"holds block 4294967299"):
        meta.write_token_maps(view, torch.tensor([0, 0]), torch.tensor([0, 4]),
                              torch.from_numpy(_with(2**32 + 3, 0, 1)), 3)
        meta.check_invariants()


# ------------------------------------------------------------ 1.2 / 1.3 dummy block
@pytest.mark.parametrize("dtype, dummy, match", [
    (torch.int32, -1, r"dummy_block_idx: -1 < 0"),
    (torch.int32, 2**31, r"dummy_block_idx: 2147483648 does not fit block_table_dtype "
                         r"torch.int32 \(max 2147483647\)"),
    (torch.int8, 200, r"dummy_block_idx: 200 does not fit block_table_dtype torch.int8 "
                      r"\(max 127\)"),
])
def test_constructor_refuses_a_dummy_block_that_is_negative_or_does_not_fit(
        dtype, dummy, match):
    """-1 sent pad tokens to block -1 and made begin_decode_for_capture fill the table
    with -1; an id past the dtype failed later inside torch (RuntimeError in
    allocate). Both are refused where the value is given."""
    with pytest.raises(ValueError, match=match):
        MTPMetadata(**config(block_table_dtype=dtype, dummy_block_idx=dummy))


def test_a_view_that_cannot_hold_the_dummy_block_is_refused(path):
    """With an int64 block table, ``dummy_block_idx = 2**33`` passes the constructor,
    but an int32 view would hold pad rows at a wrapped (real) block 0."""
    meta = make_metadata(path, block_table_dtype=torch.int64, dummy_block_idx=2**33)
    view = make_view("context")
    meta.begin_decode(1, 2, [0], TABLE, False)
    _refused(meta, [view], lambda: meta.setup_decode_step(view), ValueError,
             r"dummy_block_idx: 8589934592 does not fit gpu_view.token_to_block_idx "
             r"dtype torch.int32")


def test_largest_dummy_block_the_dtype_holds_is_accepted(path):
    meta = make_metadata(path, block_table_dtype=torch.int8, dummy_block_idx=127)
    meta.begin_decode_for_capture(2)
    assert meta.block_table[:2].unique().tolist() == [127]


# ---------------------------------------------------- 1.4 -1 block in a written column
def test_draft_depth_refuses_an_unallocated_block_in_the_column_it_writes(path):
    """Row 0 starts in column 0 and its next depth steps into column 1, which holds -1:
    unchecked, that depth would write ``token_to_block_idx = -1``. The first depth is fine;
    the second is refused before any write, and rows whose -1 columns are never
    written are accepted."""
    meta = make_metadata(path)
    view = make_view("context")
    table = _with(-1, 0, 1, _with(-1, 0, 5))
    meta.begin_decode(2, 2, [3, 5], table, False)  # row 0: position 3, column 0
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:2].tolist() == [10, 21]
    meta.advance_decode_step()  # row 0: position 4, column 1 -> -1
    _refused(meta, [view], lambda: meta.setup_decode_step(view), ValueError,
             r"block_table \(the draft loop's, from begin_decode\): block -1 at \[0, 1\] "
             r"is negative \(an unallocated block\), but draft row 0 \(offset 4\) writes")


def test_commit_pass_refuses_an_unallocated_block_in_a_written_column(path):
    meta, view = _primed(path)
    table = _with(-1, 1, 1)  # request 1 writes positions 2..5: columns 0 and 1
    _refused(meta, [view], lambda: meta.setup_commit_pass(
        view, [3, 4], table, start_positions=[0, 2]), ValueError,
        r"block_table: block -1 at \[1, 1\] is negative \(an unallocated block\), but "
        r"request 1 \(positions 2\.\.5\) writes")


def test_commit_pass_accepts_unallocated_blocks_it_does_not_write(path):
    """Positive control: -1 past a span is what a scheduler's table holds (an inherited
    column holds its shared block, tests/test_split_mistakes.py); the pass equals the
    reference's."""
    meta, ref = make_metadata(path), make_reference()
    view, ref_view = make_view("context"), make_view("reference")
    table = _with(-1, 1, 3)  # row 0 col 0 inherited (a real block); row 1 col 3 unused
    for side, v in ((meta, view), (ref, ref_view)):
        side.setup_commit_pass(v, torch.tensor([3, 4]), torch.from_numpy(table.copy()),
                               start_positions=torch.tensor([2, 0]),
                               inherited_blocks=torch.tensor([1, 0]))
    assert_views_equal(view, ref_view)


def test_write_token_maps_refuses_an_unallocated_block_it_writes(path):
    meta, view = _primed(path)
    table = _with(-1, 1, 2)
    _refused(meta, [view], lambda: meta.write_token_maps(view, [1, 1], [7, 8], table, 2),
             ValueError, r"block_table: block -1 at \[1, 2\] is negative \(an "
                         r"unallocated block\), but token 1 \(position 8\) writes")
    meta.write_token_maps(view, [1, 1], [7, 8], table, 2, inherited_blocks=[0, 3])
    assert view.token_to_block_idx[:2].tolist() == [D, D]  # both inherited: redirected


# ---------------------------------------------------- 1.5 inherited counts past [0, W]
@pytest.mark.parametrize("bad", [W + 1, -1])
def test_inherited_blocks_outside_zero_to_w_are_refused(path, bad):
    meta, view = _primed(path)
    _refused(meta, [view], lambda: meta.setup_commit_pass(
        view, [3, 2], TABLE, inherited_blocks=[0, bad]), ValueError,
        rf"inherited_blocks: {bad} at index 1 outside \[0, max_kv_block_count {W}\]")
    _refused(meta, [view], lambda: meta.write_token_maps(
        view, [0], [5], TABLE, 1, inherited_blocks=[bad]), ValueError,
        rf"inherited_blocks: {bad} at index 0 outside \[0, max_kv_block_count {W}\]")


def test_inherited_blocks_may_cover_the_whole_table(path):
    """W is legal (a request that inherited every block): every token goes to D."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.setup_commit_pass(view, [3], TABLE, start_positions=[20], inherited_blocks=[W])
    assert view.token_to_block_idx[:3].tolist() == [D, D, D]


# ------------------------- 1.5b the whole annotation buffer with paused rows first
# Rows [0, 1) paused, row 1 active with no prefix hit, row 2 active with one
# inherited block (TABLE row 2 = [30, 31, ...]: block 30 is shared). The active slice
# [1:3] reads [0, 1]; the whole buffer reads [0, 0] and let request 1 write block 30.
PAUSED = 1
_WHOLE_FORMS = {
    "tensor": lambda a: a,
    "prefix view": lambda a: a[:3],
    "numpy": lambda a: a.numpy(),
}


def _paused_first(path):
    meta, view = _primed(path)
    meta.end_forward()
    meta.request_matched_prefix_blocks[:3] = torch.tensor([0, 0, 1], dtype=torch.int32)
    meta.draft_annotation_offset = PAUSED
    return meta, view


@pytest.mark.parametrize("form", sorted(_WHOLE_FORMS))
def test_whole_annotation_buffer_with_paused_rows_first_is_refused(path, form):
    """The buffer itself from row 0 while draft_annotation_offset says rows are paused:
    a ValueError naming inherited_blocks and the slice to pass, nothing written. Accepted,
    it would send request 1's position 3 (column 0 of TABLE[2]) to the shared block 30
    in both calls."""
    meta, view = _paused_first(path)
    whole = _WHOLE_FORMS[form](meta.request_matched_prefix_blocks)
    match = (r"inherited_blocks is request_matched_prefix_blocks from row 0, but "
             r"draft_annotation_offset = 1 says the first 1 rows are paused: pass the "
             r"active slice request_matched_prefix_blocks\[1:total\]")
    _refused(meta, [view], lambda: meta.setup_commit_pass(
        view, [6, 4], TABLE[1:], start_positions=[0, 3], inherited_blocks=whole),
        ValueError, "setup_commit_pass: " + match)
    _refused(meta, [view], lambda: meta.write_token_maps(
        view, [1, 1], [3, 4], TABLE[1:], 2, inherited_blocks=whole),
        ValueError, "write_token_maps: " + match)


def test_the_active_slice_and_the_upstream_whole_buffer_without_paused_rows_pass(path):
    """Positive controls: the active slice redirects request 1's inherited column to D;
    with draft_annotation_offset 0 (no paused rows) the whole buffer, upstream's
    ``[>= P]`` signature, is read from row 0 as before."""
    meta, view = _paused_first(path)
    annotations = meta.request_matched_prefix_blocks
    meta.setup_commit_pass(view, [6, 4], TABLE[1:], start_positions=[0, 3],
                           inherited_blocks=annotations[PAUSED:3])
    assert view.token_to_block_idx[:10].tolist() == [20, 20, 20, 20, 21, 21, D, 31, 31, 31]
    meta.end_forward()
    meta.write_token_maps(view, [1, 1], [3, 4], TABLE[1:], 2,
                          inherited_blocks=annotations[PAUSED:3].numpy())
    assert view.token_to_block_idx[:2].tolist() == [D, 31]
    meta.draft_annotation_offset = 0
    annotations[:3] = torch.tensor([0, 1, 0], dtype=torch.int32)  # rows 0, 1 active
    meta.setup_commit_pass(view, [2, 2], TABLE, start_positions=[3, 3],
                           inherited_blocks=annotations)
    assert view.token_to_block_idx[:4].tolist() == [10, 11, D, 21]
    meta.check_invariants()


# ---------------------------------------------- 1.5c messages a newcomer meets (25 §4)
def test_annotations_after_deallocate_read_none_and_say_what_to_call():
    """The contract keeps the buffers None after deallocate(), so ``x[0] = 3`` fails on
    None; the property's docstring says to call allocate(device) and write the
    annotations again, and every row method says the same in a NotAllocatedError."""
    from mtpmeta import NotAllocatedError

    meta = make_metadata()
    meta.deallocate()
    assert meta.request_matched_prefix_blocks is None
    doc = " ".join(MTPMetadata.request_matched_prefix_blocks.__doc__.split())
    assert "None before allocate() and after deallocate()" in doc
    assert "call allocate(device) first, then write the annotations again" in doc
    for name, call in (("reset_request_rows", lambda: meta.reset_request_rows([0])),
                       ("move_request_rows", lambda: meta.move_request_rows([0], [1])),
                       ("swap_request_rows", lambda: meta.swap_request_rows([0], [1]))):
        with pytest.raises(NotAllocatedError, match=rf"^{name}: buffers are not "
                                                    r"allocated; call allocate\(device\)"):
            call()


def test_a_device_input_on_another_device_names_the_device_it_got():
    """The mirror path's device route names the device it got: a meta tensor (or a list
    beside one) is named, not only "every input must be a tensor on cpu"."""
    meta, view = _primed("mirror")
    on_meta = torch.zeros(2, dtype=torch.int32, device="meta")
    table = torch.zeros((2, W), dtype=torch.int32, device="meta")
    _refused(meta, [view], lambda: meta.write_token_maps(view, on_meta, on_meta, table, 2),
             ValueError, r"^rows: with device inputs every input must be a tensor on cpu, "
                         r"got a tensor on meta$")
    _refused(meta, [view], lambda: meta.begin_decode(2, 2, on_meta, table, False),
             ValueError, r"^start_positions: .* tensor on cpu, got a tensor on meta$")
    from mtpmeta.validation.inputs import check_device_tensors  # a list beside a device tensor

    with pytest.raises(ValueError, match=r"^positions: .* tensor on cpu, got a list$"):
        check_device_tensors(torch.device("cpu"), (("positions", [0, 1], 1),))


# ------------------------------------------------------------------------ 1.6 flags
@pytest.mark.parametrize("bad", ["yes", 1, None, "no"])
def test_enabled_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=rf"enabled: expected a bool .*{bad!r}"):
        MTPMetadata(**config(enabled=bad))


@pytest.mark.parametrize("bad", ["no", 0, None, [False]])
def test_graphed_must_be_a_bool(path, bad):
    """``graphed="no"`` is refused, not taken as True (the capture-time bound)."""
    meta, view = _primed(path)
    _refused(meta, [view], lambda: meta.begin_decode(2, 2, [0, 1], TABLE, graphed=bad),
             TypeError, rf"graphed: expected a bool .*{bad!r}")


def test_numpy_bools_are_flags(path):
    meta = MTPMetadata(**config(enabled=np.bool_(True)))
    assert meta.enabled is True
    meta.allocate("cpu", mirror=(path == "mirror"))
    meta.begin_decode(1, 1, [0], TABLE, graphed=np.True_)
    assert meta.graphed is True
    assert meta.setup_decode_step(make_view("context")).max_seqlen_k == W * BS


@pytest.mark.parametrize("bad", ["draft", "DRAFT", 1, None, True])
def test_forward_mode_takes_only_an_mtp_forward_mode(path, bad):
    """A string is refused: stored, it would make forward_active read True and
    check_invariants pass. Assigning a mode (upstream style) still works."""
    meta, view = _primed(path)
    meta.end_forward()
    _refused(meta, [view], lambda: setattr(meta, "forward_mode", bad), TypeError,
             r"forward_mode: expected an MTPForwardMode")
    assert meta.forward_active is False
    meta.forward_mode = MTPForwardMode.DRAFT
    assert meta.forward_mode is MTPForwardMode.DRAFT and meta.forward_active


# ---------------------------------------------------- 1.7 draft steps outside DRAFT
@pytest.mark.parametrize("method", ["advance_decode_step", "stage_decode_lengths"])
@pytest.mark.parametrize("mode", ["after end_forward", "in COMMIT"])
def test_draft_steps_refuse_outside_draft(path, method, mode):
    """Both refuse after end_forward and during a commit pass: run there, they would shift
    the offsets (or the lengths) of a loop that had ended."""
    meta, view = _primed(path)
    meta.end_forward()
    if mode == "in COMMIT":
        meta.setup_commit_pass(view, [3, 2], TABLE)
    _refused(meta, [view], getattr(meta, method), ForwardModeError,
             rf"{method}: forward_mode is {'NONE' if mode == 'after end_forward' else 'COMMIT'}"
             r", expected DRAFT")


def test_advance_may_step_past_the_table_at_the_end_of_a_loop(path):
    """Still legal: the last depth's advance steps one past the last slot; only a setup
    from there is refused."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.begin_decode(1, 1, [W * BS - 1], TABLE, False)
    meta.setup_decode_step(view)
    meta.advance_decode_step()
    assert int(meta.offsets[0]) == W * BS
    with pytest.raises(ValueError, match="active_offsets: block column 6 >= "):
        meta.setup_decode_step(view)


# ---------------------------------------------- 1.8 inherited counts of the call
def test_check_uses_the_inherited_counts_of_the_call_not_the_current_annotations(path):
    """An active slice ``request_matched_prefix_blocks[paused:total]`` is a view of the
    annotations. A scheduler that updates the annotations before checking
    (a new prefix hit for row 2) must not get a false alarm ("token 6 ... points at block
    20, expected dummy_block_idx")."""
    meta = make_metadata(path)
    view = make_view("context")
    paused, total = 1, 3
    meta.request_matched_prefix_blocks[:3] = torch.tensor([0, 1, 0], dtype=torch.int32)
    meta.setup_commit_pass(view, [3, 2], TABLE[:2], start_positions=[2, 0],
                           inherited_blocks=meta.request_matched_prefix_blocks[paused:total])
    meta.request_matched_prefix_blocks[2] = 1  # request 1 (row 2) now inherits block 0
    meta.check_invariants()  # its token 3 wrote block 20, right for the call
    view.token_to_block_idx[0] = 10  # a broken redirect is still found: request 0,
    # column 0 < its inherited 1 at the call, must hold D
    with pytest.raises(InvariantError, match=r"inherited blocks: token 0 \(row 0"):
        meta.check_invariants()


# ------------------------------------------------------- §2 messages and the docs
def test_check_invariants_refuses_an_argument_that_is_no_view(path):
    meta, _ = _primed(path)
    with pytest.raises(ValueError, match=r"gpu_view: missing tensor field"):
        meta.check_invariants("view")


def test_a_too_short_view_field_is_named_not_the_counts(path):
    """A field rebound to a short tensor is named, not reported as "append_counts: 5
    tokens > max_tokens 4", which would send the reader to the wrong argument."""
    meta, view = _primed(path)
    view.token_to_request_idx = torch.zeros(4, dtype=torch.int32)
    _refused(meta, [view], lambda: meta.setup_commit_pass(view, [3, 2], TABLE),
             ValueError, r"gpu_view.token_to_request_idx holds 4 rows, fewer than the "
                         r"other token fields")
    view = make_view("context")
    view.mha_kv_seq_lengths = torch.zeros(1, dtype=torch.int32)
    _refused(meta, [view], lambda: meta.write_mha_metadata(view, [1, 2], [1, 2],
                                                           TABLE[:2], 2),
             ValueError, r"gpu_view.mha_kv_seq_lengths holds 1 request rows")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_allocate_on_cuda_without_cuda_says_so():
    meta = MTPMetadata(**config())
    with pytest.raises(ValueError, match="CUDA is not available"):
        meta.allocate("cuda")
    assert meta.offsets is None


def test_help_lists_every_public_attribute():
    """``help(MTPMetadata)`` shows the attributes the constructor sets (not only the
    properties), the Indices type and ContextGPUView.device."""
    doc = inspect.getdoc(MTPMetadata)
    for name in ("forward_mode", "graphed", "active_request_count", "padded_count",
                 "active_offsets", "active_block_table", "last_forward",
                 "draft_annotation_offset", "Indices"):
        assert f"\n    {name}:" in doc or f"\n{name}:" in doc, name
    assert "Which MTP forward" in inspect.getdoc(MTPMetadata.forward_mode)
    assert inspect.getdoc(ContextGPUView.device)


def test_flags_are_checked_on_the_device_route_too(device_route):
    """The type check runs before the route is chosen: device tensors (CPU tensors
    treated as device ones) meet the same refusal, with nothing staged."""
    meta, view = _primed("mirror")
    _refused(meta, [view], lambda: meta.begin_decode(
        2, 2, torch.tensor([0, 1]), torch.from_numpy(TABLE), graphed="no"), TypeError,
        r"graphed: expected a bool .*'no'")
