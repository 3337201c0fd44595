"""contract §7: ``write_token_maps`` and ``write_mha_metadata``, with hand-worked values.

Geometry: W = 6, BS = 4, D = 999. Every view starts filled with the sentinel 777, so a
field that must be "left as it was" or "not written" is checked against 777.
Block table: row r holds ``[10r+10, 10r+11, ...]``, so block ``21`` is row 1 column 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import SENTINEL as S
from tests.helpers import field, make_metadata, make_view

D = 999
TABLE = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]]
TOKEN_FIELDS = ("token_to_pos_ids", "token_to_block_idx",
                "token_to_local_position_within_kv_block", "token_to_request_idx",
                "token_to_position_in_request")


def _tokens(view, count):
    return {name: field(view, name)[:count] for name in TOKEN_FIELDS}


def _untouched_from(view, start_token=None, start_request=None):
    if start_token is not None:
        for name in TOKEN_FIELDS:
            assert field(view, name)[start_token:] == [S] * (16 - start_token), name
    if start_request is not None:
        for name in ("mha_query_lengths", "mha_kv_seq_lengths"):
            assert field(view, name)[start_request:] == [S] * (8 - start_request), name
        for name in ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths"):
            assert field(view, name)[start_request + 1:] == [S] * (8 - start_request), name
        assert field(view, "mha_block_table")[start_request:] == \
            [[S] * 6] * (8 - start_request)


# --------------------------------------------------------------------- write_token_maps
@pytest.mark.parametrize("container", [
    lambda v: v,
    lambda v: np.asarray(v, dtype=np.int32),
    lambda v: torch.tensor(v, dtype=torch.int64),
], ids=["list", "numpy-int32", "tensor-int64"])
def test_token_maps_follow_the_block_column_across_a_boundary(path, container):
    """Positions 3|4 and 7|8 straddle block edges (BS 4): the second token of each pair
    must go to the NEXT column's block at slot 0, or it overwrites slot 0 of the
    previous block, which holds a committed key."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_token_maps(view, container([0, 0, 1, 1]), container([3, 4, 7, 8]),
                          container(TABLE), 4)
    assert _tokens(view, 4) == {
        "token_to_pos_ids": [3, 4, 7, 8],
        "token_to_block_idx": [10, 11, 21, 22],
        "token_to_local_position_within_kv_block": [3, 0, 3, 0],
        "token_to_request_idx": [0, 0, 1, 1],
        "token_to_position_in_request": [3, 4, 7, 8],
    }
    _untouched_from(view, start_token=4, start_request=0)


def test_token_maps_redirect_inherited_columns_to_the_dummy_block(path):
    """inherited [1, 2, 0]: row 0's column 0 and row 1's columns 0-1 belong to shared
    prefix blocks. Writing them corrupts every request that shares the prefix; only the
    block id changes, the other four fields stay real."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_token_maps(view, torch.tensor([0, 0, 1, 2]), torch.tensor([3, 4, 7, 9]),
                          torch.tensor(TABLE), 4, inherited_blocks=torch.tensor([1, 2, 0]))
    assert _tokens(view, 4) == {
        "token_to_pos_ids": [3, 4, 7, 9],
        "token_to_block_idx": [D, 11, D, 32],
        "token_to_local_position_within_kv_block": [3, 0, 3, 1],
        "token_to_request_idx": [0, 0, 1, 2],
        "token_to_position_in_request": [3, 4, 7, 9],
    }
    _untouched_from(view, start_token=4)


def test_token_map_pad_rows_get_the_dummy_block_and_nothing_else(path):
    """Pad rows [T, padded) run through the KV append: a stale block id there writes
    garbage into a live block. Their other fields are not ours to touch, and nothing at
    or beyond padded_token_count may be written."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_token_maps(view, [1, 0], [5, 2], TABLE, 5)
    assert _tokens(view, 6) == {
        "token_to_pos_ids": [5, 2, S, S, S, S],
        "token_to_block_idx": [21, 10, D, D, D, S],
        "token_to_local_position_within_kv_block": [1, 2, 0, 0, 0, S],
        "token_to_request_idx": [1, 0, S, S, S, S],
        "token_to_position_in_request": [5, 2, S, S, S, S],
    }
    _untouched_from(view, start_token=5, start_request=0)


def test_token_maps_with_only_pad_rows(path):
    """A forward with zero real tokens (all TP padding) still sends every row to D."""
    meta = make_metadata(path)
    view = make_view("context")
    empty = torch.zeros(0, dtype=torch.int64)
    meta.write_token_maps(view, empty, empty, torch.tensor(TABLE), 3)
    assert field(view, "token_to_block_idx")[:4] == [D, D, D, S]
    assert field(view, "token_to_local_position_within_kv_block")[:4] == [0, 0, 0, S]
    assert field(view, "token_to_request_idx")[:4] == [S] * 4
    _untouched_from(view, start_token=3, start_request=0)


# ------------------------------------------------------------------- write_mha_metadata
def test_mha_metadata_writes_lengths_and_running_sums(path):
    """cu arrays are what varlen attention slices q/k by; an off-by-one shifts every
    request's keys onto its neighbour's."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_mha_metadata(view, torch.tensor([3, 1, 2]), torch.tensor([5, 4, 6]),
                            torch.tensor(TABLE), 3)
    assert field(view, "mha_query_lengths")[:3] == [3, 1, 2]
    assert field(view, "mha_kv_seq_lengths")[:3] == [5, 4, 6]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 3, 4, 6]
    assert field(view, "mha_cu_kv_seq_lengths")[:4] == [0, 5, 9, 15]
    assert field(view, "mha_block_table")[:3] == TABLE
    _untouched_from(view, start_token=0, start_request=3)


def test_mha_rows_without_a_table_row_read_the_dummy_block(path):
    """B = 1 < n = 3: rows 1-2 (the trailing pad request) must read D in EVERY column; a
    leftover row from the previous forward makes the pad request read real KV."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_mha_metadata(view, [2, 3, 1], [2, 3, 1], [TABLE[0]], 3)
    assert field(view, "mha_block_table")[:4] == [TABLE[0], [D] * 6, [D] * 6, [S] * 6]
    assert field(view, "mha_cu_query_seq_lengths")[:5] == [0, 2, 5, 6, S]


def test_mha_padded_slots_attend_to_nothing(path):
    """Slots [n, padded) launch in a graphed step: zero lengths, flat sums and -1 rows
    keep them from reading any KV; nothing at or beyond padded is written."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.write_mha_metadata(view, np.array([2, 3]), np.array([4, 5]),
                            np.array(TABLE[:2]), 4)
    assert field(view, "mha_query_lengths")[:5] == [2, 3, 0, 0, S]
    assert field(view, "mha_kv_seq_lengths")[:5] == [4, 5, 0, 0, S]
    assert field(view, "mha_cu_query_seq_lengths")[:6] == [0, 2, 5, 5, 5, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:6] == [0, 4, 9, 9, 9, S]
    assert field(view, "mha_block_table")[:5] == TABLE[:2] + [[-1] * 6] * 2 + [[S] * 6]
    _untouched_from(view, start_token=0, start_request=4)


def test_mha_kv_lengths_may_be_the_query_tensor(path):
    """The commit pass passes one buffer as both; reading kv after writing q (or
    consuming the tensor) would double the sums."""
    meta = make_metadata(path)
    view = make_view("context")
    lengths = torch.tensor([2, 3], dtype=torch.int32)
    meta.write_mha_metadata(view, lengths, lengths, torch.tensor(TABLE[:2]), 2)
    assert lengths.tolist() == [2, 3]
    assert field(view, "mha_kv_seq_lengths")[:3] == [2, 3, S]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 2, 5, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:4] == [0, 2, 5, S]


def test_mha_with_no_requests_pads_every_slot(path):
    """n = 0 (an empty graphed step) still has to zero the launched slots."""
    meta = make_metadata(path)
    view = make_view("context")
    empty = torch.zeros(0, dtype=torch.int32)
    meta.write_mha_metadata(view, empty, empty, torch.zeros((0, 6), dtype=torch.int32), 2)
    assert field(view, "mha_query_lengths")[:3] == [0, 0, S]
    assert field(view, "mha_cu_query_seq_lengths")[:4] == [0, 0, 0, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:4] == [0, 0, 0, S]
    assert field(view, "mha_block_table")[:3] == [[-1] * 6] * 2 + [[S] * 6]


# ----------------------------------------------------------------- any view-like object
@pytest.mark.parametrize("kind", ["context", "reference", "namespace"])
def test_writers_accept_any_object_with_the_ten_fields(path, kind):
    """Upstream's own ContextGPUView keeps ten separate tensors; the writers must not
    assume the library's one-buffer layout (or a particular class)."""
    meta = make_metadata(path)
    view = make_view(kind)
    meta.write_token_maps(view, [0, 1, 1], [3, 4, 8], TABLE, 4,
                          inherited_blocks=[0, 2, 0])
    meta.write_mha_metadata(view, [1, 2], [4, 9], [TABLE[0]], 3)
    assert _tokens(view, 5) == {
        "token_to_pos_ids": [3, 4, 8, S, S],
        "token_to_block_idx": [10, D, 22, D, S],
        "token_to_local_position_within_kv_block": [3, 0, 0, 0, S],
        "token_to_request_idx": [0, 1, 1, S, S],
        "token_to_position_in_request": [3, 4, 8, S, S],
    }
    assert field(view, "mha_query_lengths")[:4] == [1, 2, 0, S]
    assert field(view, "mha_kv_seq_lengths")[:4] == [4, 9, 0, S]
    assert field(view, "mha_cu_query_seq_lengths")[:5] == [0, 1, 3, 3, S]
    assert field(view, "mha_cu_kv_seq_lengths")[:5] == [0, 4, 13, 13, S]
    assert field(view, "mha_block_table")[:4] == [TABLE[0], [D] * 6, [-1] * 6, [S] * 6]
    _untouched_from(view, start_token=4, start_request=3)


@pytest.mark.parametrize("kind", ["context", "reference", "namespace"])
def test_writers_follow_a_rebound_view_field(path, kind):
    """A view is resolved once and cached; rebinding one of its fields afterwards must
    send the next write to the new tensor and leave the old one alone."""
    meta = make_metadata(path)
    view = make_view(kind)
    meta.write_token_maps(view, [0], [5], TABLE, 1)
    old = view.token_to_block_idx
    assert old.tolist()[0] == 11
    view.token_to_block_idx = torch.full_like(old, S)
    meta.write_token_maps(view, [1], [9], TABLE, 1)
    assert view.token_to_block_idx.tolist()[:2] == [22, S]
    assert old.tolist()[0] == 11  # the dropped tensor is not written any more
    view.mha_block_table = torch.full((8, 5), S, dtype=torch.int32)  # narrower: rejected
    with pytest.raises(ValueError, match="width"):
        meta.write_mha_metadata(view, [1], [4], [TABLE[0]], 1)
