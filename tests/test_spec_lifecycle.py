"""contract §1 (construction and lifecycle) and §2 (forward mode), worked by hand.

Geometry (tests.helpers.config): R = 8, W = 6, BS = 4, D = 999, H = 8.
"""

from __future__ import annotations

import enum

import pytest
import torch

from mtpmeta import MTPForwardMode, MTPMetadata, NotAllocatedError
from tests.helpers import BUFFER_NAMES, config, make_metadata, make_view

D = 999
TABLE = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]


def _dirty(meta: MTPMetadata) -> None:
    """Put something non-initial into every buffer and every piece of state."""
    meta.request_matched_prefix_blocks[:] = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2],
                                                         dtype=torch.int32)
    meta.begin_decode(2, 3, torch.tensor([5, 9]), torch.tensor(TABLE), graphed=True)
    meta.stage_decode_lengths()
    meta.carry_chunk_boundary(torch.full((8,), 2.5), req_id=42, position=17)


def _assert_initial(meta: MTPMetadata, *, block_table_dtype=torch.int32,
                    hidden_dtype=torch.float32) -> None:
    prefix = meta.request_matched_prefix_blocks
    assert prefix.device.type == "cpu"
    assert prefix.dtype == torch.int32 and prefix.shape == (8,)
    assert prefix.tolist() == [0] * 8
    assert prefix.is_pinned() == torch.cuda.is_available()
    for name in ("offsets", "query_lengths", "kv_lengths"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.shape == (8,), name
        assert tensor.device.type == "cpu"
        assert tensor.tolist() == [0] * 8, name
    assert meta.block_table.dtype == block_table_dtype
    assert meta.block_table.tolist() == [[D] * 6] * 8
    assert meta.row_ids.dtype == torch.int64
    assert meta.row_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    hidden = meta.chunk_boundary_hidden
    assert hidden.dtype == hidden_dtype and hidden.shape == (1, 1, 8)
    assert hidden.float().tolist() == [[[0.0] * 8]]
    assert meta.chunk_boundary_valid is False
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (-1, -1)
    assert meta.forward_mode is MTPForwardMode.NONE


def test_construction_reserves_no_memory():
    """Construction is unconditional in the context's __init__; if it allocated, every
    context (MTP off included) would pay for worst-case buffers it never uses."""
    meta = MTPMetadata(**config())
    for name in BUFFER_NAMES + ("active_offsets", "active_block_table"):
        assert getattr(meta, name) is None, name
    assert meta.forward_mode is MTPForwardMode.NONE
    assert (meta.active_request_count, meta.padded_count, meta.graphed) == (0, 0, False)
    assert meta.chunk_boundary_valid is False
    # the eight seed parameters are kept as given
    assert (meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens,
            meta.dummy_block_idx, meta.hidden_size) == (8, 6, 4, 999, 8)
    assert (meta.block_table_dtype, meta.hidden_dtype) == (torch.int32, torch.float32)


@pytest.mark.parametrize("block_table_dtype,hidden_dtype",
                         [(torch.int32, torch.float32), (torch.int64, torch.bfloat16)])
def test_allocate_builds_every_buffer_with_spec_dtype_shape_and_fill(
        path, block_table_dtype, hidden_dtype):
    """A block table of the wrong dtype or a non-dummy fill would send an unstaged draft
    row to a real KV block; a non-zero hidden would leak into the first seam."""
    meta = make_metadata(path, block_table_dtype=block_table_dtype,
                         hidden_dtype=hidden_dtype)
    _assert_initial(meta, block_table_dtype=block_table_dtype, hidden_dtype=hidden_dtype)


def test_allocate_reports_its_path_through_the_property(path):
    """Benchmarks and debugging read ``mirror`` to know which backend is measured."""
    meta = make_metadata(path)
    assert meta.mirror is (path == "mirror")


def test_allocate_on_cpu_defaults_to_the_direct_path():
    """CI and CPU users call plain ``allocate("cpu")``; it must not pick the staging path."""
    meta = MTPMetadata(**config())
    meta.allocate("cpu")
    assert meta.mirror is False


def test_allocate_invalidates_a_live_carry(path):
    """Re-allocating (resume) with a live carry would let a stale hidden meet a new
    request that happens to reuse the id and position."""
    meta = make_metadata(path)
    meta.carry_chunk_boundary(torch.ones(8), req_id=3, position=5)
    meta.allocate("cpu", mirror=(path == "mirror"))
    assert meta.chunk_boundary_valid is False
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (-1, -1)


def test_deallocate_drops_buffers_views_mode_and_carry(path):
    """The suspend path must release every tensor; a surviving view or a DRAFT mode would
    make the resumed context run attention against freed memory."""
    meta = make_metadata(path)
    _dirty(meta)
    meta.deallocate()
    for name in BUFFER_NAMES + ("active_offsets", "active_block_table"):
        assert getattr(meta, name) is None, name
    assert meta.forward_mode is MTPForwardMode.NONE
    assert meta.chunk_boundary_valid is False
    assert (meta.chunk_boundary_req_id, meta.chunk_boundary_position) == (-1, -1)


def test_allocate_after_deallocate_is_a_fresh_zeroed_object(path):
    """Resume must not resurrect old annotations, offsets or carried hidden."""
    meta = make_metadata(path)
    _dirty(meta)
    meta.deallocate()
    meta.allocate("cpu", mirror=(path == "mirror"))
    _assert_initial(meta)
    assert meta.mirror is (path == "mirror")


def test_methods_after_deallocate_raise_an_error_naming_allocate(path):
    """A suspended context used by mistake must say how to fix it, not crash on None."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.deallocate()
    calls = {
        "reset_request_rows": lambda: meta.reset_request_rows([0]),
        "begin_decode": lambda: meta.begin_decode(1, 1, [0], [[1] * 6], False),
        "stage_prefill_lengths": lambda: meta.stage_prefill_lengths([1], 0),
        "write_token_maps": lambda: meta.write_token_maps(view, [0], [0], [[1] * 6], 1),
        "take_chunk_boundary": lambda: meta.take_chunk_boundary(1, 1),
    }
    for name, call in calls.items():
        with pytest.raises((ValueError, RuntimeError), match="allocate"):
            call()


@pytest.mark.parametrize("allocated_before", [False, True])
def test_take_without_buffers_is_also_the_missing_carry_assertion(path, allocated_before):
    """Upstream raised an AssertionError for a take with no live carry; an unallocated
    object has none, so code that catches AssertionError must keep working."""
    meta = MTPMetadata(**config())
    if allocated_before:
        meta.allocate("cpu", mirror=(path == "mirror"))
        meta.carry_chunk_boundary(torch.ones(8), req_id=1, position=2)
        meta.deallocate()
    with pytest.raises(AssertionError, match="allocate"):
        meta.take_chunk_boundary(1, 2)
    with pytest.raises(NotAllocatedError):
        meta.take_chunk_boundary(1, 2)


def test_disabled_object_is_inert(path):
    """With MTP off the context still calls the row hooks every step: they must cost
    nothing, allocate nothing, and never flip the forward mode."""
    meta = MTPMetadata(**config(enabled=False))
    meta.allocate("cpu", mirror=(path == "mirror"))
    for name in BUFFER_NAMES:
        assert getattr(meta, name) is None, name
    meta.reset_request_rows()
    meta.reset_request_rows([0, 1])
    meta.move_request_rows([0, 1], [2, 3])
    meta.swap_request_rows([0], [1])
    meta.carry_chunk_boundary(torch.ones(8), req_id=1, position=2)
    assert meta.chunk_boundary_valid is False
    assert meta.forward_mode is MTPForwardMode.NONE
    for name in BUFFER_NAMES:
        assert getattr(meta, name) is None, name


def test_disabled_capture_raises_an_assertion_error_subclass():
    """Upstream asserted ``self.enabled`` here; warmup code that catches AssertionError
    to detect MTP-off must keep working."""
    meta = MTPMetadata(**config(enabled=False))
    meta.allocate("cpu")
    with pytest.raises(AssertionError):
        meta.begin_decode_for_capture(4)
    assert meta.forward_mode is MTPForwardMode.NONE


# ------------------------------------------------------------------------ §2 forward mode
def test_forward_mode_enum_has_the_three_upstream_values():
    """Callers compare against (and log) the upstream string values."""
    assert issubclass(MTPForwardMode, enum.Enum)
    assert [(m.name, m.value) for m in MTPForwardMode] == [
        ("NONE", "none"), ("DRAFT", "draft"), ("COMMIT", "commit")]


@pytest.mark.parametrize("mode,active,varlen", [
    (MTPForwardMode.NONE, False, False),
    (MTPForwardMode.DRAFT, True, False),
    (MTPForwardMode.COMMIT, True, True),
])
def test_forward_flags_follow_the_mode(mode, active, varlen):
    """is_varlen_forward picks the attention kernel: a draft depth sent to varlen (or a
    commit pass to the uniform decode kernel) reads the wrong query rows."""
    meta = make_metadata("direct")
    meta.forward_mode = mode
    assert meta.forward_active is active
    assert meta.is_varlen_forward is varlen


def test_entry_points_move_the_mode_through_draft_commit_and_none(path):
    """begin_decode enters DRAFT, setup_commit_pass COMMIT, end_forward leaves."""
    meta = make_metadata(path)
    view = make_view("context")
    meta.begin_decode(1, 1, [0], [[1] * 6], False)
    assert (meta.forward_mode, meta.forward_active, meta.is_varlen_forward) == (
        MTPForwardMode.DRAFT, True, False)
    meta.end_forward()
    assert (meta.forward_mode, meta.forward_active) == (MTPForwardMode.NONE, False)
    meta.setup_commit_pass(view, [2], [[1] * 6])
    assert (meta.forward_mode, meta.forward_active, meta.is_varlen_forward) == (
        MTPForwardMode.COMMIT, True, True)
    meta.end_forward()
    assert (meta.forward_active, meta.is_varlen_forward) == (False, False)


def test_reallocate_mid_draft_loop_leaves_no_stale_forward(path):
    """allocate() on an allocated object drops the old buffers; a DRAFT mode left
    behind would point the next advance at views of freed memory."""
    from tests.helpers import make_metadata

    meta = make_metadata(path)
    table = torch.zeros((2, meta.max_kv_block_count), dtype=torch.int32)
    meta.begin_decode(2, 2, torch.tensor([1, 2]), table, False)
    meta.allocate("cpu", mirror=(path == "mirror"))
    assert meta.forward_mode is MTPForwardMode.NONE
    assert meta.active_offsets is None
    assert torch.equal(meta.offsets, torch.zeros_like(meta.offsets))
