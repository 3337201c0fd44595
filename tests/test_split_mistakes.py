"""A scheduler's ordinary mistakes with the row split and prefix hits.

Failure story: each mistake below once wrote KV to the wrong place silently: a paused
request's blocks, a shared prefix block rewritten, a request's own KV sent to the dummy
block. Each must now be corrected (the destinations equal the reference's for the
correct slices), refused with every buffer and the view unchanged, or, where it is
upstream's own calling convention, caught by ``check_invariants`` once the caller
tells it the split. The context here: ``R = 8`` rows, row 0 paused (request Z), rows 1
and 2 active (requests A and B); B inherited its first block from the prefix cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import MTPMetadata
from mtpmeta.errors import InvariantError
from tests.helpers import (assert_same_state, buffer_state, config, make_reference,
                           make_view, view_state)

R, W, BS, D = 8, 6, 4, 999
PAUSED, TOTAL = 1, 3
N = TOTAL - PAUSED


@pytest.fixture(params=["direct", "mirror"])
def path(request):
    return request.param


def _meta(path: str) -> MTPMetadata:
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=(path == "mirror"))
    return meta


def _table() -> torch.Tensor:
    """The context's whole table: row ``r`` holds blocks ``10 r .. 10 r + W - 1``; rows
    past the active ones are unallocated."""
    table = torch.full((R, W), -1, dtype=torch.int32)
    for row in range(TOTAL):
        table[row] = torch.arange(10 * row, 10 * row + W, dtype=torch.int32)
    return table


def _state(meta, view):
    return buffer_state(meta), view_state(view), meta.last_forward


def _assert_unchanged(meta, view, before) -> None:
    assert_same_state(before[0], buffer_state(meta))
    after = view_state(view)
    for name, value in before[1].items():
        assert torch.equal(value, after[name]), name
    assert meta.last_forward is before[2]


def _written(view, count: int) -> list:
    return view.token_to_block_idx[:count].tolist()


# ---------------------------------------------- (a) whole arrays, no split declared
def test_whole_arrays_without_a_split_read_rows_from_0_and_the_told_check_catches_it(path):
    """Upstream's convention: with no split, rows ``[0, P)`` of an ``R``-row array, the
    paused request's included. The check passes as long as it does not know the split;
    told the split and the context's table, it names the paused row's block."""
    meta, ref = _meta(path), make_reference()
    table = _table()
    counts = torch.tensor([3, 2], dtype=torch.int32)
    view, ref_view = make_view("context", R, 16, W), make_view("reference", R, 16, W)
    got = meta.setup_commit_pass(view, counts, table, padded_token_count=8)
    assert got == ref.setup_commit_pass(ref_view, counts, table, padded_token_count=8)
    assert _written(view, 5) == [0, 0, 0, 10, 10]  # row 0: the paused request Z
    _caught_only_when_told(meta, table)


def _caught_only_when_told(meta, table) -> None:
    """Not told the split, the check passes; told it and the context's table, it
    names the paused row's block."""
    meta.check_invariants()
    with pytest.raises(InvariantError, match="context rows"):
        meta.check_invariants(request_rows=(PAUSED, TOTAL), block_table=table)


def test_whole_table_to_begin_decode_without_a_split_is_caught_when_told(path):
    meta, table, view = _meta(path), _table(), make_view("context", R, 16, W)
    meta.begin_decode(N, N, torch.tensor([5, 6], dtype=torch.int32), table, False)
    meta.setup_decode_step(view)
    _caught_only_when_told(meta, table)


def test_the_told_check_passes_the_active_rows(path):
    meta, table, view = _meta(path), _table(), make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, torch.tensor([3, 2], dtype=torch.int32), table,
                           padded_token_count=8)
    meta.check_invariants(request_rows=(PAUSED, TOTAL), block_table=table)


@pytest.mark.parametrize("rows", [(2, 1), (0, R + 1), (1.0, 3), "13", (1, 2, 3)])
def test_a_bad_told_split_is_named(path, rows):
    meta = _meta(path)
    with pytest.raises(ValueError, match="request_rows"):
        meta.check_invariants(request_rows=rows)


# ------------------------------------------ (b) a stale split after more requests paused
def test_a_split_not_declared_again_is_refused_and_changes_nothing(path):
    """Step 1 declares (1, 3); before step 2 request A is paused too (rows 0 and 1
    paused): a caller that forgets the new declaration must not get the old split,
    which would read A's row, now paused, for B."""
    meta = _meta(path)
    table = _table()
    view = make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table)
    meta.end_forward()
    meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), table, False)
    meta.setup_decode_step(view)
    meta.end_forward()
    before = _state(meta, view)  # step 2: the paused count grew to 2, not declared
    with pytest.raises(ValueError, match="set_request_rows"):
        meta.setup_commit_pass(view, torch.tensor([3], dtype=torch.int32), table)
    _assert_unchanged(meta, view, before)
    with pytest.raises(ValueError, match="set_request_rows"):
        meta.begin_decode(1, 1, torch.tensor([3], dtype=torch.int32), table, False)
    _assert_unchanged(meta, view, before)
    meta.set_request_rows(2, TOTAL)  # declared: B's row is read
    meta.setup_commit_pass(view, torch.tensor([3], dtype=torch.int32), table)
    assert _written(view, 3) == [20, 20, 20]


def test_a_second_commit_pass_on_one_split_is_refused(path):
    meta = _meta(path)
    table = _table()
    view = make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table)
    before = _state(meta, view)
    with pytest.raises(ValueError, match="set_request_rows"):
        meta.setup_commit_pass(view, torch.tensor([1, 1], dtype=torch.int32), table)
    _assert_unchanged(meta, view, before)


def test_reallocating_ends_the_split(path):
    meta = _meta(path)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.deallocate()
    meta.allocate("cpu", mirror=(path == "mirror"))
    with pytest.raises(ValueError, match="set_request_rows"):
        meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), _table(), False)


def test_without_any_declaration_every_call_is_upstreams(path):
    """An object whose caller never declares a split is never refused for it."""
    meta = _meta(path)
    view = make_view("context", R, 16, W)
    table = _table()[PAUSED:TOTAL]
    for _ in range(2):
        meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table)
        meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), table, False)
        meta.end_forward()


# ------------------------------------ (c) the caller's own compacted R-row table
def test_a_compacted_table_is_passed_as_its_first_rows(path):
    """With a split live, an ``R``-row array is the context's: a table of the caller's
    own that holds A and B in rows 0 and 1 is read from row ``paused`` (B and a stale
    tail row). Passed as ``[:P]`` it gives the reference's destinations; passed whole,
    the check told the split and the context's table names the stale row."""
    context = _table()
    compacted = torch.full((R, W), -1, dtype=torch.int32)
    compacted[:N] = context[PAUSED:TOTAL]
    compacted[N] = torch.arange(70, 70 + W, dtype=torch.int32)  # a stale tail row
    counts = torch.tensor([3, 2], dtype=torch.int32)
    meta, ref = _meta(path), make_reference()
    view, ref_view = make_view("context", R, 16, W), make_view("reference", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    assert meta.setup_commit_pass(view, counts, compacted[:N], padded_token_count=8) == \
        ref.setup_commit_pass(ref_view, counts, context[PAUSED:TOTAL],
                              padded_token_count=8)
    assert _written(view, 5) == _written(ref_view, 5) == [10, 10, 10, 20, 20]
    meta.check_invariants(request_rows=(PAUSED, TOTAL), block_table=context)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, counts, compacted, padded_token_count=8)
    assert _written(view, 5) == [20, 20, 20, 70, 70]  # the documented reading
    with pytest.raises(InvariantError, match="context rows"):
        meta.check_invariants(request_rows=(PAUSED, TOTAL), block_table=context)


# ------------------------------------------- (d) draft_annotation_offset and the split
def test_setting_the_offset_to_the_paused_count_keeps_the_split(path):
    meta = _meta(path)
    table = _table()
    meta.set_request_rows(PAUSED, TOTAL)
    meta.draft_annotation_offset = PAUSED  # as docs/architecture.md once advised
    meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), table, False)
    assert torch.equal(meta.block_table[:N], table[PAUSED:TOTAL])


@pytest.mark.parametrize("offset", [0, 2])
def test_another_offset_while_a_split_lives_is_refused_and_changes_nothing(path, offset):
    meta = _meta(path)
    table = _table()
    meta.set_request_rows(PAUSED, TOTAL)
    with pytest.raises(ValueError, match="draft_annotation_offset"):
        meta.draft_annotation_offset = offset
    assert meta.draft_annotation_offset == PAUSED
    meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), table, False)
    assert torch.equal(meta.block_table[:N], table[PAUSED:TOTAL])
    meta.draft_annotation_offset = offset  # the split ended: the offset is free
    assert meta.draft_annotation_offset == offset


def test_the_offset_without_a_split_keeps_upstreams_reading(path):
    meta = _meta(path)
    table = _table()
    meta.draft_annotation_offset = PAUSED
    meta.begin_decode(N, N, torch.tensor([2, 2], dtype=torch.int32), table, False)
    assert torch.equal(meta.block_table[:N], table[:N])


# ------------------------------------------------ (e) prefix hits protected by default
def _hit(meta) -> None:
    """B (row 2) inherited its first block: positions 0..3 lie in shared block 20."""
    meta.request_matched_prefix_blocks[TOTAL - 1] = 1


def test_a_forgotten_inherited_blocks_is_the_annotations_with_a_split(path):
    meta, ref = _meta(path), make_reference()
    _hit(meta)
    table = _table()
    counts, starts = (torch.tensor(x, dtype=torch.int32) for x in ([2, 3], [0, 2]))
    view, ref_view = make_view("context", R, 16, W), make_view("reference", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    got = meta.setup_commit_pass(view, counts, table, start_positions=starts,
                                 padded_token_count=8)
    want = ref.setup_commit_pass(ref_view, counts, table[PAUSED:TOTAL],
                                 start_positions=starts,
                                 inherited_blocks=torch.tensor([0, 1], dtype=torch.int32),
                                 padded_token_count=8)
    assert got == want
    assert _written(view, 5) == _written(ref_view, 5) == [10, 10, D, D, 21]
    meta.check_invariants(request_rows=(PAUSED, TOTAL), block_table=table)


def test_an_annotations_reference_kept_across_reallocation_stays_live(path):
    meta = _meta(path)
    kept = meta.request_matched_prefix_blocks
    meta.deallocate()
    meta.allocate("cpu", mirror=(path == "mirror"))
    assert meta.request_matched_prefix_blocks is kept
    kept[TOTAL - 1] = 1  # the prefix hit, written through the kept reference
    view = make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32), _table(),
                           start_positions=torch.tensor([0, 2], dtype=torch.int32))
    assert _written(view, 5) == [10, 10, D, D, 21]


def test_reallocation_zeroes_the_kept_annotations(path):
    meta = _meta(path)
    kept = meta.request_matched_prefix_blocks
    kept.fill_(2)
    meta.deallocate()
    assert meta.request_matched_prefix_blocks is None
    meta.allocate("cpu", mirror=(path == "mirror"))
    assert kept.tolist() == [0] * R


def test_the_check_cross_checks_an_explicit_redirect_against_the_annotations(path):
    """With a split, ``inherited_blocks`` given explicitly but lower than the
    annotations say: the shared block is rewritten, and the check names it."""
    meta = _meta(path)
    _hit(meta)
    view = make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)

    def commit():
        meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32), _table(),
                               start_positions=torch.tensor([0, 2], dtype=torch.int32),
                               inherited_blocks=torch.zeros(N, dtype=torch.int32))

    if getattr(MTPMetadata.setup_commit_pass, "__invariant_checked__", False):
        with pytest.raises(InvariantError, match="prefix redirect"):
            commit()  # MTPMETA_DEBUG=1 checks right after the call
        return
    commit()
    assert 20 in _written(view, 5)
    with pytest.raises(InvariantError, match="prefix redirect"):
        meta.check_invariants()


def test_a_forgotten_redirect_without_a_split_is_caught_when_told(path):
    """No split: upstream's ``inherited_blocks=None`` redirects nothing; told the split,
    the check reads the annotations of the active rows and names the shared block."""
    meta = _meta(path)
    _hit(meta)
    view = make_view("context", R, 16, W)
    meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32),
                           _table()[PAUSED:TOTAL],
                           start_positions=torch.tensor([0, 2], dtype=torch.int32))
    meta.check_invariants()
    with pytest.raises(InvariantError, match="prefix redirect"):
        meta.check_invariants(request_rows=(PAUSED, TOTAL))


# --------------------------------------------- (f) a repeated destination of a move
@pytest.mark.parametrize("src, dst", [([1, 2], [3, 3]), ([4, 5], [-1, R - 1]),
                                      (np.array([1, 2]), torch.tensor([0, 0]))])
def test_a_move_into_one_row_twice_is_refused_and_changes_nothing(path, src, dst):
    meta = _meta(path)
    meta.request_matched_prefix_blocks.copy_(torch.arange(R, dtype=torch.int32) % W)
    before = meta.request_matched_prefix_blocks.clone()
    with pytest.raises(ValueError, match="dst_idxs repeats row"):
        meta.move_request_rows(src, dst)
    assert torch.equal(meta.request_matched_prefix_blocks, before)


def test_a_move_from_one_row_into_two_is_a_copy(path):
    meta = _meta(path)
    meta.request_matched_prefix_blocks.copy_(torch.arange(R, dtype=torch.int32) % W)
    meta.move_request_rows([1, 1], [4, 5])
    assert meta.request_matched_prefix_blocks.tolist() == [0, 1, 2, 3, 1, 1, 0, 1]


# ------------------------------------- (g) an inherited count over an unallocated column
@pytest.mark.parametrize("split", [False, True])
def test_an_inherited_count_over_an_unallocated_column_is_refused(path, split):
    """B's row holds 2 blocks; a count of 3 covers column 2, which is -1: the count is
    wrong, and B's own KV there would go to the dummy block."""
    meta = _meta(path)
    table = _table()
    table[TOTAL - 1, 2:] = -1
    view = make_view("context", R, 16, W)
    before = _state(meta, view)
    inherited = torch.tensor([0, 3], dtype=torch.int32)
    if split:
        meta.set_request_rows(PAUSED, TOTAL)
        meta.request_matched_prefix_blocks[TOTAL - 1] = 3
        before = _state(meta, view)
        inherited, table_arg = None, table
    else:
        table_arg = table[PAUSED:TOTAL]
    with pytest.raises(ValueError, match=r"inherited_blocks: request 1 inherits 3 "
                                         r"blocks, but block_table\[1, 2\] is -1"):
        meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table_arg,
                               start_positions=torch.tensor([0, 8], dtype=torch.int32),
                               inherited_blocks=inherited)
    _assert_unchanged(meta, view, before)


def test_an_inherited_count_above_the_shared_blocks_is_caught_by_the_check(path):
    """B's annotation says 1 shared block, but the pass is given 2 over allocated
    columns: B's own position 4 goes to the dummy block. Told the split (or with the
    split served), the check compares with the annotations and names the lost token."""
    meta = _meta(path)
    _hit(meta)
    view = make_view("context", R, 16, W)

    def commit():
        meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32),
                               _table()[PAUSED:TOTAL],
                               start_positions=torch.tensor([0, 3], dtype=torch.int32),
                               inherited_blocks=torch.tensor([0, 2], dtype=torch.int32))

    commit()
    assert _written(view, 5) == [10, 10, D, D, D]  # position 4 of B: lost
    with pytest.raises(InvariantError, match="the request's own KV is lost"):
        meta.check_invariants(request_rows=(PAUSED, TOTAL))


def test_an_inherited_count_within_the_allocated_columns_passes(path):
    meta = _meta(path)
    table = _table()[PAUSED:TOTAL].clone()
    table[1, 2:] = -1
    view = make_view("context", R, 16, W)
    meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table,
                           start_positions=torch.tensor([0, 6], dtype=torch.int32),
                           inherited_blocks=torch.tensor([0, 2], dtype=torch.int32))
    assert _written(view, 4) == [10, 10, D, D]


# ------------------------------------------- (h) a draft start in a protected place
def test_a_draft_start_inside_an_inherited_block_is_refused(path):
    meta = _meta(path)
    _hit(meta)
    table = _table()
    view = make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    before = _state(meta, view)
    with pytest.raises(ValueError, match=r"draft row 1 \(context row 2\) starts at 3, "
                                         r"inside its 1 inherited blocks"):
        meta.begin_decode(N, N, torch.tensor([5, 3], dtype=torch.int32), table, False)
    _assert_unchanged(meta, view, before)
    assert meta.draft_annotation_offset == PAUSED
    meta.begin_decode(N, N, torch.tensor([5, 4], dtype=torch.int32), table, False)


def _b_committed_4_to_6(path):
    """The split declared and a commit pass in which A writes 0..1 and B 4..6:
    ``(meta, table, view)``."""
    meta, table, view = _meta(path), _table(), make_view("context", R, 16, W)
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32), table,
                           start_positions=torch.tensor([0, 4], dtype=torch.int32))
    return meta, table, view


def test_a_draft_start_inside_the_span_just_committed_is_refused(path):
    """B committed positions 4..6; a draft from 5 would overwrite position 5 (the
    per-row start array shifted by the paused row is the usual way to get there)."""
    meta, table, view = _b_committed_4_to_6(path)
    meta.end_forward()
    before = _state(meta, view)
    with pytest.raises(ValueError, match=r"draft row 1 \(context row 2\) starts at 5, "
                                         r"inside positions 4\.\.6"):
        meta.begin_decode(N, N, torch.tensor([2, 5], dtype=torch.int32), table, False)
    _assert_unchanged(meta, view, before)
    meta.begin_decode(N, N, torch.tensor([2, 7], dtype=torch.int32), table, False)
    meta.setup_decode_step(view)
    meta.check_invariants()


def test_a_draft_after_other_writes_is_not_held_to_an_earlier_pass(path):
    """Only the commit pass right before the begin (and on the rows as they were)
    binds its starts: after a row move the spans name other requests."""
    meta, table, view = _b_committed_4_to_6(path)
    meta.move_request_rows([2], [1])
    meta.reset_request_rows([2])
    meta.set_request_rows(PAUSED, TOTAL - 1)
    meta.begin_decode(1, 1, torch.tensor([1], dtype=torch.int32), table, False)
