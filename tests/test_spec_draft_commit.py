"""contract §5 (draft loop), §6 (commit-pass lengths) and the fused entry points
``setup_decode_step`` / ``setup_commit_pass``, with values worked out by hand.

Default geometry: R = 8, W = 6, BS = 4, D = 999; the fused draft example uses BS = 8.
Views are prefilled with the sentinel 777 so "not written" is checkable.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mtpmeta import ForwardShape, MTPForwardMode
from tests.helpers import SENTINEL as S
from tests.helpers import field, make_metadata, make_view

D = 999
TABLE = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]]


# -------------------------------------------------------------------------- §5 draft loop
def test_begin_decode_copies_inputs_and_never_aliases_them(path):
    """If offsets aliased the caller's positions, advancing the depth would corrupt the
    scheduler's committed positions; a later scheduler edit must not reach the loop."""
    meta = make_metadata(path)
    starts = torch.tensor([5, 11, 2], dtype=torch.int32)
    table = torch.tensor(TABLE, dtype=torch.int32)
    meta.begin_decode(2, 3, starts, table, graphed=False)
    starts.fill_(0)
    table.fill_(0)
    assert meta.offsets.tolist() == [5, 11, 0, 0, 0, 0, 0, 0]
    assert meta.block_table.tolist() == TABLE[:2] + [[D] * 6] * 6
    meta.advance_decode_step()
    assert starts.tolist() == [0, 0, 0] and table.sum().item() == 0
    assert meta.offsets.tolist() == [6, 12, 0, 0, 0, 0, 0, 0]


def test_begin_decode_sets_state_and_active_views_of_the_persistent_buffers(path):
    """Captured graphs read active_offsets/active_block_table by address; a fresh tensor
    per begin_decode would leave the graph reading last step's positions."""
    meta = make_metadata(path)
    meta.begin_decode(2, 4, np.array([5, 11]), np.array(TABLE), graphed=True)
    assert (meta.active_request_count, meta.padded_count, meta.graphed) == (2, 4, True)
    assert meta.forward_mode is MTPForwardMode.DRAFT
    assert meta.active_offsets.shape == (2,)
    assert meta.active_offsets.data_ptr() == meta.offsets.data_ptr()
    assert meta.active_block_table.shape == (2, 6)
    assert meta.active_block_table.data_ptr() == meta.block_table.data_ptr()
    assert meta.active_offsets.tolist() == [5, 11]
    meta.advance_decode_step()
    assert meta.active_offsets.tolist() == [6, 12]


def test_begin_decode_for_capture_points_padded_rows_at_the_dummy_block(path):
    """Capture must only touch scratch KV: a real block id left in rows [0, p) would let
    warmup overwrite live cache. Rows beyond p keep what they had."""
    meta = make_metadata(path)
    meta.begin_decode(3, 3, [5, 11, 2], TABLE, graphed=False)
    meta.end_forward()
    meta.begin_decode_for_capture(2)
    assert meta.offsets.tolist() == [0, 0, 2, 0, 0, 0, 0, 0]
    assert meta.block_table.tolist()[:3] == [[D] * 6, [D] * 6, TABLE[2]]
    assert (meta.active_request_count, meta.padded_count, meta.graphed) == (2, 2, True)
    assert meta.forward_mode is MTPForwardMode.DRAFT


def test_advance_moves_only_the_active_rows(path):
    """Advancing inactive rows would shift a later begin_decode's stale tail."""
    meta = make_metadata(path)
    meta.begin_decode(3, 3, [5, 11, 2], TABLE, graphed=False)
    meta.begin_decode(2, 2, [7, 1], TABLE, graphed=False)
    meta.advance_decode_step()
    meta.advance_decode_step()
    assert meta.offsets.tolist()[:3] == [9, 3, 2]


def test_end_forward_changes_only_the_mode(path):
    """end_forward runs between a draft depth and the commit pass; if it cleared views or
    offsets the next depth would write position 0 of the dummy block."""
    meta = make_metadata(path)
    meta.begin_decode(2, 3, [5, 11], TABLE, graphed=True)
    meta.stage_decode_lengths()
    before = (meta.offsets.clone(), meta.block_table.clone(), meta.query_lengths.clone(),
              meta.kv_lengths.clone(), meta.active_offsets.data_ptr())
    meta.end_forward()
    assert meta.forward_mode is MTPForwardMode.NONE
    assert (meta.active_request_count, meta.padded_count, meta.graphed) == (2, 3, True)
    after = (meta.offsets, meta.block_table, meta.query_lengths, meta.kv_lengths)
    for a, b in zip(before[:4], after):
        assert torch.equal(a, b)
    assert meta.active_offsets.data_ptr() == before[4]
    assert meta.active_offsets.tolist() == [5, 11]


def test_decode_lengths_are_one_query_and_position_plus_one_keys(path):
    """Write-then-attend: the token at offset o must see o + 1 keys, itself included;
    an off-by-one hides the freshly written key or reads one past it."""
    meta = make_metadata(path)
    meta.begin_decode(2, 4, [5, 11], TABLE, graphed=False)
    q, kv = meta.stage_decode_lengths()
    assert (q.tolist(), kv.tolist()) == ([1, 1], [6, 12])
    assert q.data_ptr() == meta.query_lengths.data_ptr()
    assert kv.data_ptr() == meta.kv_lengths.data_ptr()
    assert meta.query_lengths.tolist()[2:] == [0] * 6
    meta.advance_decode_step()
    q, kv = meta.stage_decode_lengths()
    assert (q.tolist(), kv.tolist()) == ([1, 1], [7, 13])


# ------------------------------------------------------------------ §6 commit-pass lengths
@pytest.mark.parametrize("counts,pad,max_requests,expected", [
    ([3, 2], 3, 8, [3, 2, 3]),  # spare slot: the pad rows get their own request
    ([3, 2], 3, 2, [3, 5]),  # full batch: the last real request grows
    ([3, 2], 0, 8, [3, 2]),  # no pad: P long
    ([], 5, 8, [5]),  # nothing real, only pad rows
], ids=["spare-slot", "full-batch", "no-pad", "empty"])
def test_prefill_lengths_absorb_the_pad_rows(path, counts, pad, max_requests, expected):
    """Varlen needs cu_seqlens[-1] == q.shape[0]; an unowned pad row makes flash-attn read
    past the last request (or assert)."""
    meta = make_metadata(path, max_requests=max_requests)
    lengths = meta.stage_prefill_lengths(torch.tensor(counts, dtype=torch.int32), pad)
    assert lengths.tolist() == expected
    assert lengths.data_ptr() == meta.query_lengths.data_ptr()


def test_prefill_lengths_leave_slots_beyond_the_view_alone(path):
    """The returned view is exactly P (or P + 1) long; staging must not spill into the
    next slot, which a previous forward may still describe."""
    meta = make_metadata(path)
    meta.stage_prefill_lengths([7, 7, 7, 7], 0)
    assert meta.stage_prefill_lengths(np.array([3, 2]), 0).tolist() == [3, 2]
    assert meta.query_lengths.tolist()[:4] == [3, 2, 7, 7]
    assert meta.stage_prefill_lengths([1], 4).tolist() == [1, 4]
    assert meta.query_lengths.tolist()[:4] == [1, 4, 7, 7]


# -------------------------------------------------------------------- setup_decode_step
def test_decode_step_matches_the_worked_example(path):
    """BS 8, rows [[3,4,..],[7,9,..]], offsets [5,11]: token 0 -> block 3 slot 5, token 1
    -> column 1 of row 1 = block 9 slot 3; KV lengths [6,12]. Any slip writes a real KV
    slot of another position."""
    meta = make_metadata(path, block_size_tokens=8)
    view = make_view("context")
    table = [[3, 4, D, D, D, D], [7, 9, D, D, D, D]]
    meta.begin_decode(2, 2, torch.tensor([5, 11]), torch.tensor(table), graphed=False)
    shape = meta.setup_decode_step(view)
    assert shape == ForwardShape(token_count=2, padded_token_count=2, request_count=2,
                                 padded_request_count=2, max_seqlen_q=1, max_seqlen_k=12)
    assert field(view, "token_to_block_idx")[:3] == [3, 9, S]
    assert field(view, "token_to_local_position_within_kv_block")[:3] == [5, 3, S]
    assert field(view, "token_to_request_idx")[:3] == [0, 1, S]
    assert field(view, "token_to_position_in_request")[:3] == [5, 11, S]
    assert field(view, "token_to_pos_ids")[:3] == [5, 11, S]
    assert field(view, "mha_query_lengths")[:3] == [1, 1, S]
    assert field(view, "mha_kv_seq_lengths")[:3] == [6, 12, S]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 1, 2, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:4] == [0, 6, 18, S]
    assert field(view, "mha_block_table")[:3] == table + [[S] * 6]
    assert meta.forward_mode is MTPForwardMode.DRAFT


def test_decode_step_pads_to_dummy_tokens_and_empty_requests(path):
    """Padded slots of a graphed depth must write only the dummy block and attend to
    nothing; the pad rows' other token fields stay as they were."""
    meta = make_metadata(path, block_size_tokens=8)
    view = make_view("context")
    table = [[3, 4, D, D, D, D], [7, 9, D, D, D, D]]
    meta.begin_decode(2, 4, [5, 11], table, graphed=True)
    shape = meta.setup_decode_step(view)
    assert shape == ForwardShape(2, 4, 2, 4, 1, 6 * 8)  # graphed: the bound W * BS
    assert field(view, "token_to_block_idx")[:5] == [3, 9, D, D, S]
    assert field(view, "token_to_local_position_within_kv_block")[:5] == [5, 3, 0, 0, S]
    assert field(view, "token_to_request_idx")[:5] == [0, 1, S, S, S]
    assert field(view, "token_to_pos_ids")[:5] == [5, 11, S, S, S]
    assert field(view, "mha_query_lengths")[:5] == [1, 1, 0, 0, S]
    assert field(view, "mha_kv_seq_lengths")[:5] == [6, 12, 0, 0, S]
    assert field(view, "mha_cu_query_seq_lengths")[:6] == [0, 1, 2, 2, 2, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:6] == [0, 6, 18, 18, 18, S]
    assert field(view, "mha_block_table")[:5] == table + [[-1] * 6] * 2 + [[S] * 6]


def test_decode_step_crosses_a_block_boundary_after_advance(path):
    """Offsets 7 and 15 sit in the last slot of a block; one advance must move both to
    slot 0 of the NEXT column, not wrap inside the old block."""
    meta = make_metadata(path, block_size_tokens=8)
    view = make_view("context")
    table = [[3, 4, D, D, D, D], [7, 9, 10, D, D, D]]
    meta.begin_decode(2, 2, [7, 15], table, graphed=False)
    meta.setup_decode_step(view)
    assert field(view, "token_to_block_idx")[:2] == [3, 9]
    assert field(view, "token_to_local_position_within_kv_block")[:2] == [7, 7]
    meta.advance_decode_step()
    shape = meta.setup_decode_step(view)
    assert field(view, "token_to_block_idx")[:2] == [4, 10]
    assert field(view, "token_to_local_position_within_kv_block")[:2] == [0, 0]
    assert field(view, "token_to_pos_ids")[:2] == [8, 16]
    assert field(view, "mha_kv_seq_lengths")[:2] == [9, 17]
    assert shape.max_seqlen_k == 17


def test_decode_step_after_capture_staging_touches_only_the_dummy_block(path):
    """The capture forward runs setup_decode_step too; every token must land at slot 0
    of the dummy block and attend to exactly one key."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.begin_decode_for_capture(3)
    assert meta.setup_decode_step(view) == ForwardShape(3, 3, 3, 3, 1, 6 * 4)  # W * BS
    assert field(view, "token_to_block_idx")[:4] == [D, D, D, S]
    assert field(view, "token_to_local_position_within_kv_block")[:4] == [0, 0, 0, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:5] == [0, 1, 2, 3, S]
    assert field(view, "mha_block_table")[:3] == [[D] * 6] * 3


# -------------------------------------------------------------------- setup_commit_pass
def _commit(path, max_requests=8, **kwargs):
    meta = make_metadata(path, max_requests=max_requests)
    view = make_view("context", max_requests=max_requests)
    shape = meta.setup_commit_pass(view, kwargs.pop("counts"), kwargs.pop("table", TABLE),
                                   **kwargs)
    return meta, view, shape


def test_commit_pass_defaults_to_spans_starting_at_zero(path):
    """counts [3, 2], no starts: rows [0,0,0,1,1] at positions [0,1,2,0,1]."""
    meta, view, shape = _commit(path, counts=[3, 2])
    assert shape == ForwardShape(5, 5, 2, 2, 3, 3)
    assert field(view, "token_to_request_idx")[:6] == [0, 0, 0, 1, 1, S]
    assert field(view, "token_to_pos_ids")[:6] == [0, 1, 2, 0, 1, S]
    assert field(view, "token_to_position_in_request")[:6] == [0, 1, 2, 0, 1, S]
    assert field(view, "token_to_block_idx")[:6] == [10, 10, 10, 20, 20, S]
    assert field(view, "token_to_local_position_within_kv_block")[:6] == [0, 1, 2, 0, 1, S]
    assert field(view, "mha_query_lengths")[:3] == [3, 2, S]
    assert field(view, "mha_kv_seq_lengths")[:3] == [3, 2, S]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 3, 5, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:4] == [0, 3, 5, S]
    assert field(view, "mha_block_table")[:3] == TABLE[:2] + [[S] * 6]
    assert meta.forward_mode is MTPForwardMode.COMMIT and meta.is_varlen_forward


def test_commit_pass_spans_start_at_start_positions_and_cross_blocks(path):
    """counts [2, 3], starts [3, 6]: positions [3,4 | 6,7,8] -> columns [0,1 | 1,1,2]."""
    _, view, shape = _commit(path, counts=[2, 3], start_positions=[3, 6])
    assert shape == ForwardShape(5, 5, 2, 2, 3, 3)
    assert field(view, "token_to_pos_ids")[:5] == [3, 4, 6, 7, 8]
    assert field(view, "token_to_block_idx")[:5] == [10, 11, 21, 21, 22]
    assert field(view, "token_to_local_position_within_kv_block")[:5] == [3, 0, 2, 3, 0]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 2, 5, S]


def test_commit_pass_never_writes_inherited_blocks(path):
    """inherited [1, 2]: request 0's column 0 and request 1's columns 0-1 are shared,
    ref-counted prefix blocks; writing them corrupts every request sharing them."""
    _, view, _ = _commit(path, counts=[2, 3], start_positions=[3, 6],
                         inherited_blocks=[1, 2])
    assert field(view, "token_to_block_idx")[:6] == [D, 11, D, D, 22, S]
    assert field(view, "token_to_local_position_within_kv_block")[:5] == [3, 0, 2, 3, 0]
    assert field(view, "token_to_request_idx")[:5] == [0, 0, 1, 1, 1]


def test_commit_pass_gives_the_pad_rows_a_spare_request(path):
    """padded_token_count 8 over 5 real tokens, P = 2 < R: the 3 pad rows become request
    2, which reads only the dummy block; pad tokens write the dummy block."""
    _, view, shape = _commit(path, counts=[3, 2], padded_token_count=8)
    assert shape == ForwardShape(5, 8, 3, 3, 3, 3)
    assert field(view, "token_to_block_idx")[:9] == [10, 10, 10, 20, 20, D, D, D, S]
    assert field(view, "token_to_local_position_within_kv_block")[:9] == \
        [0, 1, 2, 0, 1, 0, 0, 0, S]
    assert field(view, "token_to_request_idx")[:9] == [0, 0, 0, 1, 1, S, S, S, S]
    assert field(view, "mha_query_lengths")[:4] == [3, 2, 3, S]
    assert field(view, "mha_cu_query_seq_lengths")[:5] == [0, 3, 5, 8, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:5] == [0, 3, 5, 8, S]
    assert field(view, "mha_block_table")[:4] == TABLE[:2] + [[D] * 6, [S] * 6]


def test_commit_pass_full_batch_grows_the_last_request(path):
    """P == R leaves no spare slot: request 1 owns the 3 pad rows (length 5). It writes
    positions 0-1 (column 0) but attends over 5 keys, so its columns from 1 on read the
    dummy block, never a block it was not given (SPEC 6)."""
    _, view, shape = _commit(path, max_requests=2, counts=[3, 2], table=TABLE[:2],
                             padded_token_count=8)
    assert shape == ForwardShape(5, 8, 2, 2, 5, 5)
    assert field(view, "mha_query_lengths") == [3, 5]
    assert field(view, "mha_cu_query_seq_lengths") == [0, 3, 8]
    assert field(view, "mha_block_table") == [TABLE[0], [20] + [D] * 5]
    assert field(view, "token_to_block_idx")[:9] == [10, 10, 10, 20, 20, D, D, D, S]


@pytest.mark.parametrize("padded_tokens,padded_requests,expected_shape,lengths,cu", [
    (None, 4, ForwardShape(5, 5, 2, 4, 3, 3), [3, 2, 0, 0, S], [0, 3, 5, 5, 5, S]),
    (6, 5, ForwardShape(5, 6, 3, 5, 3, 3), [3, 2, 1, 0, 0, S], [0, 3, 5, 6, 6, 6, S]),
    (6, 2, ForwardShape(5, 6, 3, 3, 3, 3), [3, 2, 1, S], [0, 3, 5, 6, S]),
], ids=["request-padding", "both-paddings", "staged-beats-padding"])
def test_commit_pass_pads_request_slots_with_empty_rows(
        path, padded_tokens, padded_requests, expected_shape, lengths, cu):
    """Padded request slots launch but must attend to nothing (-1 table rows); the
    launch count is never below the staged count, or the pad request is dropped."""
    _, view, shape = _commit(path, counts=[3, 2], padded_token_count=padded_tokens,
                             padded_request_count=padded_requests)
    assert shape == expected_shape
    n = len(lengths)
    assert field(view, "mha_query_lengths")[:n] == lengths
    assert field(view, "mha_kv_seq_lengths")[:n] == lengths
    assert field(view, "mha_cu_query_seq_lengths")[:n + 1] == cu
    staged, padded = expected_shape.request_count, expected_shape.padded_request_count
    table = field(view, "mha_block_table")
    assert table[staged:padded] == [[-1] * 6] * (padded - staged)
    assert table[padded] == [S] * 6


def test_forward_shape_is_frozen():
    """The shape is returned to the caller's graph-key cache; mutating it in place would
    silently change the key of a captured graph."""
    shape = ForwardShape(1, 2, 1, 2, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.token_count = 5
