"""The scheduler's row split, declared once per step (``set_request_rows``).

Failure story: a scheduler keeps paused requests in the first rows of its context and
the active ones after them. Passing a context array whole where the library wants the
active slice writes KV into the wrong blocks, silently: the paused request's blocks, a
shared prefix block, or the dummy block for real tokens. With the split declared, an
array of exactly ``R`` rows is the context's whole array and the library takes its
active rows; every other length is the active slice, as without a split. Each mistake
below, made with the split declared, must give the reference's destinations for the
correct slices; bad declarations are refused and change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import VIEW_FIELDS, MTPMetadata
from mtpmeta.reference import ReferenceMTPMetadata
from tests.helpers import config, make_view

R, W, BS, D = 8, 6, 4, 999
PAUSED, TOTAL = 1, 3  # one paused row in front of two active ones


def _context(seed: int = 0):
    """The context's whole arrays: a block table, start positions, prefix-hit counts."""
    rng = np.random.default_rng(seed)
    table = torch.tensor(rng.permutation(R * W)[:R * W].reshape(R, W), dtype=torch.int32)
    starts = torch.tensor(rng.integers(0, 8, size=R), dtype=torch.int32)
    inherited = torch.zeros(R, dtype=torch.int32)
    inherited[PAUSED] = 1  # request A reuses its first (shared prefix) block
    return table, starts, inherited


def _pair(path: str):
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=(path == "mirror"))
    ref = ReferenceMTPMetadata(**config())
    ref.allocate("cpu")
    return meta, ref


def _views():
    return make_view("context", R, 32, W), make_view("reference", R, 32, W)


def _assert_same(view, ref_view) -> None:
    for f in VIEW_FIELDS:
        assert torch.equal(getattr(view, f.name), getattr(ref_view, f.name)), f.name


@pytest.fixture(params=["direct", "mirror"])
def path(request):
    return request.param


# ------------------------------------------------------------- the four mistakes
def test_whole_arrays_to_a_commit_pass_write_the_active_requests_destinations(path):
    """The whole block table, per-row start positions and the whole annotation buffer
    (as ``inherited_blocks``) to ``setup_commit_pass``, with the split declared."""
    meta, ref = _pair(path)
    table, starts, inherited = _context()
    counts = torch.tensor([5, 3], dtype=torch.int32)
    view, ref_view = _views()
    meta.set_request_rows(PAUSED, TOTAL)
    got = meta.setup_commit_pass(view, counts, table, start_positions=starts,
                                 inherited_blocks=inherited, padded_token_count=16)
    active = slice(PAUSED, TOTAL)
    want = ref.setup_commit_pass(ref_view, counts, table[active],
                                 start_positions=starts[active],
                                 inherited_blocks=inherited[active], padded_token_count=16)
    assert got == want
    _assert_same(view, ref_view)
    # the paused request's blocks are never written
    written = set(view.token_to_block_idx[:8].tolist())
    assert not written & set(table[0].tolist())


def test_whole_annotation_buffer_as_inherited_blocks_keeps_the_shared_block(path):
    """Upstream's annotations passed whole: request A's shared prefix block must go to
    the dummy block, not be rewritten."""
    meta, _ = _pair(path)
    table, _, _ = _context()
    meta.request_matched_prefix_blocks[PAUSED] = 1
    counts = torch.tensor([6, 2], dtype=torch.int32)
    view, _ = _views()
    meta.set_request_rows(PAUSED, TOTAL)
    meta.setup_commit_pass(view, counts, table,
                           inherited_blocks=meta.request_matched_prefix_blocks,
                           padded_token_count=8)
    blocks = view.token_to_block_idx[:8].tolist()
    assert blocks[:4] == [D] * 4  # A's positions 0..3 lie in its inherited block
    assert int(table[PAUSED, 0]) not in blocks


def test_whole_block_table_to_begin_decode_drafts_into_the_active_rows(path):
    meta, ref = _pair(path)
    table, starts, _ = _context(1)
    view, ref_view = _views()
    meta.set_request_rows(PAUSED, TOTAL)
    meta.begin_decode(2, 2, starts, table, False)
    ref.begin_decode(2, 2, starts[PAUSED:TOTAL], table[PAUSED:TOTAL], False)
    assert torch.equal(meta.block_table[:2], ref.block_table[:2])
    assert torch.equal(meta.offsets[:2], ref.offsets[:2])
    assert meta.setup_decode_step(view) == ref.setup_decode_step(ref_view)
    _assert_same(view, ref_view)


def test_whole_block_counts_follow_the_same_rule(path):
    """``block_counts`` of ``R`` entries is the context's, of another length the active
    slice's: both give the same draft loop and commit pass."""
    table, starts, _ = _context(2)
    counts = torch.full((R,), W, dtype=torch.int32)
    results = []
    for whole in (True, False):
        meta, _ = _pair(path)
        view, _ = _views()
        meta.set_request_rows(PAUSED, TOTAL)
        block_counts = counts if whole else counts[PAUSED:TOTAL]
        meta.begin_decode(2, 2, starts, table, False, block_counts=block_counts)
        meta.setup_decode_step(view)
        meta.end_forward()
        meta.set_request_rows(PAUSED, TOTAL)  # the next step's split
        meta.setup_commit_pass(view, torch.tensor([2, 3], dtype=torch.int32), table,
                               start_positions=starts, padded_token_count=8,
                               block_counts=block_counts)
        results.append({f.name: getattr(view, f.name).clone() for f in VIEW_FIELDS})
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_an_active_slice_is_still_an_active_slice_with_the_split_declared(path):
    meta, ref = _pair(path)
    table, starts, _ = _context(3)
    view, ref_view = _views()
    meta.set_request_rows(PAUSED, TOTAL)
    active = slice(PAUSED, TOTAL)
    counts = torch.tensor([4, 4], dtype=torch.int32)
    assert meta.setup_commit_pass(view, counts, table[active],
                                  start_positions=starts[active], padded_token_count=8) \
        == ref.setup_commit_pass(ref_view, counts, table[active],
                                 start_positions=starts[active], padded_token_count=8)
    _assert_same(view, ref_view)


# --------------------------------------------------------- without a declared split
def test_without_a_split_whole_arrays_mean_what_they_meant(path):
    """No split: rows ``[:P]`` of a whole array, exactly as upstream reads them."""
    meta, ref = _pair(path)
    table, starts, _ = _context(4)
    view, ref_view = _views()
    counts = torch.tensor([3, 2], dtype=torch.int32)
    assert meta.setup_commit_pass(view, counts, table, start_positions=starts,
                                  padded_token_count=8) == \
        ref.setup_commit_pass(ref_view, counts, table, start_positions=starts,
                              padded_token_count=8)
    _assert_same(view, ref_view)


def test_the_offset_alone_still_refuses_the_whole_annotation_buffer(path):
    meta, _ = _pair(path)
    table, _, _ = _context()
    view, _ = _views()
    meta.draft_annotation_offset = PAUSED
    with pytest.raises(ValueError, match="inherited_blocks"):
        meta.setup_commit_pass(view, torch.tensor([2, 2], dtype=torch.int32), table,
                               inherited_blocks=meta.request_matched_prefix_blocks)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("paused, total, error, words", [
    (-1, 3, ValueError, "paused_count"),
    (4, 3, ValueError, "paused_count"),
    (0, R + 1, ValueError, "total_count"),
    (1.0, 3, TypeError, "paused_count"),
    ("1", 3, TypeError, "paused_count"),
    (True, 3, TypeError, "paused_count"),
    (1, None, TypeError, "total_count"),
])
def test_bad_split_is_refused_and_changes_nothing(path, paused, total, error, words):
    meta, _ = _pair(path)
    meta.set_request_rows(2, 5)
    with pytest.raises(error, match=words):
        meta.set_request_rows(paused, total)
    assert meta.draft_annotation_offset == 2
    table, starts, _ = _context()
    meta.begin_decode(3, 3, starts, table, False)  # still the (2, 5) split
    assert torch.equal(meta.block_table[:3], table[2:5])


def test_more_active_rows_than_the_split_holds_are_refused(path):
    meta, _ = _pair(path)
    table, starts, _ = _context()
    meta.set_request_rows(PAUSED, TOTAL)
    before = meta.block_table.clone()
    with pytest.raises(ValueError, match="active_request_count"):
        meta.begin_decode(3, 3, starts, table, False)
    assert torch.equal(meta.block_table, before)
    view, _ = _views()
    with pytest.raises(ValueError, match="append_counts"):
        meta.setup_commit_pass(view, torch.tensor([1, 1, 1], dtype=torch.int32), table)
    assert torch.equal(meta.block_table, before)


@pytest.mark.parametrize("value, error", [(-3, ValueError), (R + 1, ValueError),
                                          ("1", TypeError), (1.0, TypeError),
                                          (True, TypeError), (None, TypeError)])
def test_bad_draft_annotation_offset_is_refused_and_changes_nothing(path, value, error):
    meta, _ = _pair(path)
    meta.draft_annotation_offset = 2
    with pytest.raises(error, match="draft_annotation_offset"):
        meta.draft_annotation_offset = value
    assert meta.draft_annotation_offset == 2


def test_draft_annotation_offset_takes_numpy_ints(path):
    meta, _ = _pair(path)
    meta.draft_annotation_offset = np.int64(3)
    assert meta.draft_annotation_offset == 3 and type(meta.draft_annotation_offset) is int


@pytest.mark.parametrize("src, dst", [([1, 2], [3, 3]), ([1, 1], [3, 4])])
def test_swap_with_a_repeated_index_is_refused_and_changes_nothing(path, src, dst):
    meta, _ = _pair(path)
    meta.request_matched_prefix_blocks.copy_(torch.arange(R, dtype=torch.int32))
    before = meta.request_matched_prefix_blocks.clone()
    with pytest.raises(ValueError, match="repeat"):
        meta.swap_request_rows(src, dst)
    assert torch.equal(meta.request_matched_prefix_blocks, before)
