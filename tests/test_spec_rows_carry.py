"""contract §3 (request-row annotations) and §4 (chunked-prefill boundary carry), by hand.

Geometry: R = 8, H = 8, W = 20. Rows start as ``[10, 11, ..., 17]`` so every row is
distinct (W is wide enough for them to be valid inherited-block counts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import ChunkCarryError, MTPMetadata
from tests.helpers import config, make_metadata

START = [10, 11, 12, 13, 14, 15, 16, 17]


def _rows(path: str) -> MTPMetadata:
    meta = make_metadata(path, max_kv_block_count=20)
    meta.request_matched_prefix_blocks[:] = torch.tensor(START, dtype=torch.int32)
    return meta


def _annotations(meta: MTPMetadata) -> list:
    return meta.request_matched_prefix_blocks.tolist()


# ---------------------------------------------------------------------------- §3 rows
@pytest.mark.parametrize("index,expected", [
    (slice(2, 5), [10, 11, 0, 0, 0, 15, 16, 17]),
    (3, [10, 11, 12, 0, 14, 15, 16, 17]),
    ([1, 6], [10, 0, 12, 13, 14, 15, 0, 17]),
    (np.array([0, 7], dtype=np.int32), [0, 11, 12, 13, 14, 15, 16, 0]),
    (torch.tensor([2, 4]), [10, 11, 0, 13, 0, 15, 16, 17]),
    (torch.tensor([True, False, False, False, False, True, False, True]),
     [0, 11, 12, 13, 14, 0, 16, 0]),
    (np.array([-1, -8]), [0, 11, 12, 13, 14, 15, 16, 0]),
], ids=["slice", "int", "list", "numpy", "tensor", "bool-mask", "negative"])
def test_reset_zeroes_exactly_the_selected_rows(path, index, expected):
    """A released row that keeps its prefix count makes the next request in that row skip
    KV writes for blocks it never inherited; a reset that spills clears live rows."""
    meta = _rows(path)
    meta.reset_request_rows(index)
    assert _annotations(meta) == expected


def test_reset_without_arguments_clears_every_row(path):
    """The default selection is every row (a full context reset)."""
    meta = _rows(path)
    meta.reset_request_rows()
    assert _annotations(meta) == [0] * 8


@pytest.mark.parametrize("src,dst,expected", [
    ([0, 1, 2], [1, 2, 3], [10, 10, 11, 12, 14, 15, 16, 17]),
    ([1, 2, 3], [0, 1, 2], [11, 12, 13, 13, 14, 15, 16, 17]),
    ([0, 1], [5, 6], [10, 11, 12, 13, 14, 10, 11, 17]),
    ([-1], [0], [17, 11, 12, 13, 14, 15, 16, 17]),
], ids=["overlap-forward", "overlap-backward", "disjoint", "negative"])
def test_move_reads_every_source_before_writing(path, src, dst, expected):
    """A row-by-row move over [0,1,2]->[1,2,3] would smear row 0 across all four rows
    ([10,10,10,10]) and hand three requests the wrong prefix count."""
    meta = _rows(path)
    meta.move_request_rows(src, dst)
    assert _annotations(meta) == expected


@pytest.mark.parametrize("as_index", [
    lambda v: np.asarray(v, dtype=np.int32),
    lambda v: torch.tensor(v, dtype=torch.int32),
], ids=["numpy-int32", "tensor-int32"])
def test_move_takes_any_index_container(path, as_index):
    """The scheduler passes int64 tensors (the swap tests), other callers lists (the move
    tests) or int32 arrays and tensors (here); all must index the same rows."""
    meta = _rows(path)
    meta.move_request_rows(as_index([6, 7]), as_index([0, 1]))
    assert _annotations(meta) == [16, 17, 12, 13, 14, 15, 16, 17]


@pytest.mark.parametrize("src,dst,expected", [
    ([0, 1], [6, 7], [16, 17, 12, 13, 14, 15, 10, 11]),
    # both sides read first: old src [10, 11], old dst [11, 12];
    # x[1] = 10, x[2] = 11, then x[0] = 11, x[1] = 12 (second assignment wins)
    ([0, 1], [1, 2], [11, 12, 11, 13, 14, 15, 16, 17]),
    ([-1], [-8], [17, 11, 12, 13, 14, 15, 16, 10]),
], ids=["disjoint", "index-on-both-sides", "negative"])
def test_swap_reads_both_sides_then_assigns_dst_then_src(path, src, dst, expected):
    """Paused/active swaps must exchange prefix counts exactly like upstream's two
    advanced-index assignments, including where an index appears on both sides."""
    meta = _rows(path)
    meta.swap_request_rows(torch.tensor(src), torch.tensor(dst))
    assert _annotations(meta) == expected


def test_row_operations_never_touch_the_carry(path):
    """The carry is keyed by request id: a row shuffle that invalidated it would drop a
    chunked request's seam hidden mid-prompt."""
    meta = _rows(path)
    hidden = torch.arange(8, dtype=torch.float32)
    meta.carry_chunk_boundary(hidden, req_id=5, position=31)
    meta.reset_request_rows()
    meta.move_request_rows([0, 1], [2, 3])
    meta.swap_request_rows([4], [5])
    assert meta.chunk_boundary_valid is True
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (5, 31)
    assert meta.take_chunk_boundary(5, 31).flatten().tolist() == hidden.tolist()


# ---------------------------------------------------------------------------- §4 carry
def test_invalidate_clears_keys_but_keeps_the_hidden_buffer(path):
    """A captured graph reads the carry buffer by address: invalidating must not move it."""
    meta = make_metadata(path)
    address = meta.chunk_boundary_hidden.data_ptr()
    meta.carry_chunk_boundary(torch.ones(8), req_id=2, position=9)
    meta.invalidate_chunk_boundary()
    assert meta.chunk_boundary_valid is False
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (-1, -1)
    assert meta.chunk_boundary_hidden.data_ptr() == address
    meta.carry_chunk_boundary(torch.ones(8), req_id=3, position=4)
    assert meta.chunk_boundary_hidden.data_ptr() == address


def test_carry_copies_the_hidden_instead_of_aliasing_it(path):
    """The caller frees (and the allocator reuses) the step's activations right after
    the carry; an alias would hand the next chunk garbage at its seam."""
    meta = make_metadata(path)
    hidden = torch.arange(8, dtype=torch.float32)
    meta.carry_chunk_boundary(hidden, req_id=7, position=10)
    hidden.fill_(-1.0)
    assert meta.chunk_boundary_hidden.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert meta.chunk_boundary_valid is True
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (7, 10)


@pytest.mark.parametrize("shape", [(8,), (1, 8), (2, 4), (1, 1, 8), (8, 1), (1, 1, 1, 8),
                                   (2, 2, 2)])
def test_carry_accepts_any_shape_with_hidden_size_elements(path, shape):
    """The main model hands ``[1, H]`` or ``[H]`` depending on the call site."""
    meta = make_metadata(path)
    meta.carry_chunk_boundary(torch.arange(8, dtype=torch.float32).reshape(shape),
                              req_id=1, position=2)
    out = meta.take_chunk_boundary(1, 2)
    assert out.shape == (1, 1, 8)
    assert out.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("shape", [(8,), (1, 1, 8)])
def test_a_meta_hidden_carries_only_into_a_meta_carry(path, shape):
    """A meta tensor holds no data: refused, naming the carry's device, where the carry
    holds data; on a metadata allocated on ``meta`` (the bench's host-cost replays) it
    is that device's tensor, carried as any other, keys recorded."""
    hidden = torch.zeros(shape, device="meta")
    meta = make_metadata(path)
    meta.carry_chunk_boundary(torch.arange(8, dtype=torch.float32), req_id=5, position=6)
    before = meta.chunk_boundary_hidden.clone()
    with pytest.raises(ValueError, match="hidden: a meta tensor holds no data to carry "
                                         "into cpu"):
        meta.carry_chunk_boundary(hidden, req_id=1, position=2)
    assert torch.equal(meta.chunk_boundary_hidden, before)  # nothing changed
    assert (meta.chunk_boundary_valid, meta.chunk_boundary_req_id,
            meta.chunk_boundary_position) == (True, 5, 6)
    on_meta = MTPMetadata(**config())
    on_meta.allocate("meta")  # the mirror path: the direct one is CPU-only
    on_meta.carry_chunk_boundary(hidden, req_id=1, position=2)
    assert (on_meta.chunk_boundary_valid, on_meta.chunk_boundary_req_id,
            on_meta.chunk_boundary_position) == (True, 1, 2)
    assert on_meta.take_chunk_boundary(1, 2).is_meta


def test_take_returns_the_persistent_buffer_itself(path):
    """A copy would allocate inside the step (not graph safe) and break address checks."""
    meta = make_metadata(path)
    meta.carry_chunk_boundary(torch.ones(8), req_id=4, position=6)
    assert meta.take_chunk_boundary(4, 6) is meta.chunk_boundary_hidden


@pytest.mark.parametrize("carry,take,words", [
    (None, (5, 10), ["5", "10"]),
    ((7, 10), (8, 10), ["7", "8"]),
    ((7, 10), (7, 11), ["10", "11"]),
], ids=["no-carry", "other-request", "other-position"])
def test_take_refuses_a_carry_that_does_not_match(path, carry, take, words):
    """Returning a stale or foreign hidden (or silently skipping the seam) writes a wrong
    committed position; the error must say which condition broke and the values."""
    meta = make_metadata(path)
    if carry is not None:
        meta.carry_chunk_boundary(torch.ones(8), req_id=carry[0], position=carry[1])
    with pytest.raises(ChunkCarryError) as info:
        meta.take_chunk_boundary(*take)
    assert isinstance(info.value, AssertionError)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert meta.chunk_boundary_valid is (carry is not None)


def test_invalidated_carry_cannot_be_taken(path):
    """After invalidate, even the exact (req_id, position) that was carried is refused."""
    meta = make_metadata(path)
    meta.carry_chunk_boundary(torch.ones(8), req_id=3, position=4)
    meta.invalidate_chunk_boundary()
    with pytest.raises(ChunkCarryError):
        meta.take_chunk_boundary(3, 4)
