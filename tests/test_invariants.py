"""``check_invariants``: passes after valid sequences, names each invariant it catches.

Geometry (tests.helpers.config): R = 8, W = 6, BS = 4, D = 999. Block ids in ``TABLE``
are 0..47, never D, so a redirect to the dummy block is visible. Each failure test breaks
one invariant by hand (overwriting a view row, a buffer entry or the mode) and checks
that the message names the invariant and the offending token, slot or row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mtpmeta
from mtpmeta import ContextGPUView, InvariantError, MTPForwardMode, MTPMetadata
from mtpmeta.errors import ChunkCarryError
from mtpmeta.debug.invariants import install_debug_checks
from tests.helpers import config, make_metadata, make_views

D = 999
R, W, BS = 8, 6, 4
# Tests about when a check runs assume the import-time wrapping is off.
debug_env_off = pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                                   reason="MTPMETA_DEBUG=1 already wraps MTPMetadata")
TABLE = np.arange(R * W, dtype=np.int32).reshape(R, W)  # real block ids, never D


def _draft(meta, view, starts=(5, 9, 13), padded=5):
    """begin_decode for len(starts) requests padded to ``padded``, one setup. The
    default starts lie past the inherited blocks of ``_commit``'s annotations [1, 0, 2],
    also after the row move [2] -> [1] some tests make ([1, 2, 2])."""
    meta.begin_decode(len(starts), padded, np.array(starts), TABLE, False)
    return meta.setup_decode_step(view)


def _commit(meta, view, padded_request_count=6, padded_token_count=12):
    """Three requests with prefix hits [1, 0, 2] (own annotations), 9 tokens.

    counts [3, 4, 2] from [0, 2, 5]: tokens 0-2 row 0 (col 0 < 1: dummy), 3-6 row 1,
    7-8 row 2 (cols 1, 1 < 2: dummy); pad 3 -> spare slot 3; padded slots [4, 6).
    """
    meta.request_matched_prefix_blocks[:3] = torch.tensor([1, 0, 2], dtype=torch.int32)
    return meta.setup_commit_pass(
        view, [3, 4, 2], TABLE, start_positions=[0, 2, 5],
        inherited_blocks=meta.request_matched_prefix_blocks,
        padded_token_count=padded_token_count, padded_request_count=padded_request_count)


def _checked_meta(path):
    meta = make_metadata(path)
    view, _ = make_views(meta)
    return meta, view


# ------------------------------------------------------------------------- passing
def test_invariants_hold_through_a_valid_scheduler_sequence(path):
    """Every call of a realistic sequence (row ops, carry, draft loops with request
    padding, a capture warm-up, a padded commit pass with inherited blocks, direct
    writer calls, suspend/resume) leaves every invariant intact; a checker that fired
    here would make MTPMETA_DEBUG=1 unusable."""
    meta = MTPMetadata(**config())
    meta.check_invariants()  # enabled, unallocated
    meta.allocate("cpu", mirror=(path == "mirror"))
    view, _ = make_views(meta)
    steps = [
        lambda: meta.request_matched_prefix_blocks.copy_(
            torch.tensor([1, 0, 2, 6, 0, 0, 3, 0], dtype=torch.int32)),
        lambda: meta.move_request_rows([3, 4], [4, 5]),
        lambda: meta.swap_request_rows([0], [6]),
        lambda: meta.reset_request_rows(slice(3, None)),
        lambda: meta.carry_chunk_boundary(torch.ones(8), 7, 11),
        lambda: meta.take_chunk_boundary(7, 11),
        # draft positions past each row's inherited blocks (annotations [3, 0, 2])
        lambda: meta.begin_decode(3, 5, np.array([13, 6, 9]), TABLE, False),
        lambda: meta.setup_decode_step(view),
        lambda: meta.advance_decode_step(),
        lambda: meta.setup_decode_step(view),
        lambda: meta.stage_decode_lengths(),
        lambda: meta.advance_decode_step(),
        lambda: meta.end_forward(),
        lambda: meta.begin_decode_for_capture(4),
        lambda: meta.setup_decode_step(view),
        lambda: meta.end_forward(),
        lambda: _commit(meta, view),
        lambda: meta.write_token_maps(view, [0], [4], TABLE, 2),  # writers during COMMIT
        lambda: meta.write_mha_metadata(view, [1], [5], TABLE[:1], 2),
        lambda: meta.end_forward(),
        lambda: _commit(meta, view),
        lambda: meta.end_forward(),
        lambda: meta.move_request_rows([2], [1]),  # row 1 now "inherits" 2 blocks
        lambda: meta.stage_prefill_lengths([3, 2], 3),
        lambda: meta.write_token_maps(view, [0, 1, 1], [0, 4, 9], TABLE, 7,
                                      inherited_blocks=[1, 2]),
        lambda: meta.write_mha_metadata(view, [2, 3], [4, 5], TABLE[:1], 5),
        lambda: meta.write_mha_metadata(view, [], [], TABLE[:0], 0),
        lambda: meta.deallocate(),
        lambda: meta.allocate("cpu", mirror=(path == "mirror")),
        lambda: _commit(meta, view, padded_request_count=3, padded_token_count=9),
    ]
    for i, step in enumerate(steps):
        step()
        meta.check_invariants()
        meta.check_invariants(view)


def test_disabled_object_passes_and_stays_inert():
    """A disabled object after every no-op call is NONE and holds nothing."""
    meta = MTPMetadata(**config(enabled=False))
    meta.allocate("cpu")
    meta.reset_request_rows()
    meta.move_request_rows([0], [1])
    meta.carry_chunk_boundary(torch.ones(8), 1, 2)
    meta.end_forward()
    meta.check_invariants()


def test_draft_offsets_may_end_one_past_the_table_after_the_last_advance(path):
    """A request drafting into its very last slot (W * BS - 1 = 23) is advanced to 24
    by the loop's final advance_decode_step while still in DRAFT. That is a valid end
    of a loop (no setup reads it), so the offsets bound is inclusive at W * BS."""
    meta, view = _checked_meta(path)
    _draft(meta, view, starts=(W * BS - 1,), padded=1)
    meta.advance_decode_step()
    assert int(meta.offsets[0]) == W * BS
    meta.check_invariants()


@debug_env_off
def test_first_check_keeps_the_inherited_counts_of_its_forward(path):
    """The caller's inherited array (here the annotations themselves) may change after
    the pass, by a row move, before or after the first check: the record holds the
    counts of the call, so the pass's (correct) token maps never look wrong. A broken
    redirect (a protected token pointing at a real block) is still reported."""
    meta, view = _checked_meta(path)
    _commit(meta, view)
    meta.end_forward()
    meta.check_invariants()
    meta.move_request_rows([2], [1])  # row 1: 0 -> 2 inherited blocks
    meta.check_invariants()

    fresh, fresh_view = _checked_meta(path)
    _commit(fresh, fresh_view)
    fresh.move_request_rows([2], [1])
    fresh.check_invariants()  # the counts of the call: row 1 inherited nothing
    fresh_view.token_to_block_idx[0] = 7  # token 0: row 0, column 0 < inherited 1
    with pytest.raises(InvariantError, match=r"inherited blocks: token 0 \(row 0"):
        fresh.check_invariants()


def test_explicit_gpu_view_is_the_one_checked(path):
    """``check_invariants(view)`` checks the given view against the last forward: a
    fresh zero view (pad rows at block 0) fails where the written one passes."""
    meta, view = _checked_meta(path)
    _draft(meta, view)
    meta.check_invariants(view)
    with pytest.raises(InvariantError, match="padded token rows: token 3"):
        meta.check_invariants(ContextGPUView(R, 64, W))


def test_invariant_error_is_an_exported_assertion_error():
    assert issubclass(InvariantError, AssertionError)
    assert mtpmeta.InvariantError is InvariantError and "InvariantError" in mtpmeta.__all__


# ------------------------------------------------------------------------ breaking
def test_padded_token_rows_never_write_real_kv(path):
    """Pad token rows [T, padded) must write the dummy block at offset 0: a pad row that
    pointed at block 7 would scribble the draft KV of whichever request owns block 7."""
    meta, view = _checked_meta(path)
    _draft(meta, view)  # T = 3, padded = 5
    view.token_to_block_idx[4] = 7
    with pytest.raises(InvariantError, match=r"^padded token rows: token 4 \(pad rows "
                       r"\[3, 5\) of the last decode forward\) has token_to_block_idx 7"):
        meta.check_invariants()
    view.token_to_block_idx[4] = D
    meta.check_invariants()

    _commit(meta, view)  # T = 9, padded = 12
    view.token_to_local_position_within_kv_block[10] = 2
    with pytest.raises(InvariantError, match=r"^padded token rows: token 10 .*commit "
                       r"forward\) has token_to_local_position_within_kv_block 2, "
                       r"expected 0"):
        meta.check_invariants()


@pytest.mark.parametrize("field, index, value, message", [
    ("mha_query_lengths", 4, 1, r"slot 4 .* has mha_query_lengths 1, expected 0"),
    ("mha_kv_seq_lengths", 5, 3, r"slot 5 .* has mha_kv_seq_lengths 3, expected 0"),
    ("mha_cu_query_seq_lengths", 6, 13, r"mha_cu_query_seq_lengths\[6\] = 13 .*flat at "
                                        r"cu\[4\] = 12"),
    ("mha_cu_kv_seq_lengths", 5, 12 - 1, r"mha_cu_kv_seq_lengths\[5\] = 11"),
    ("mha_block_table", (5, 2), 3, r"slot 5 .* mha_block_table row \[-1, -1, 3, -1, -1, "
                                   r"-1\], expected all -1"),
])
def test_padded_request_slots_read_nothing(path, field, index, value, message):
    """Pad slots [n, padded) need zero lengths, flat cu entries and -1 block rows: a
    pad slot with a length or a block id makes attention read a real KV block."""
    meta, view = _checked_meta(path)
    _commit(meta, view)  # staged n = 4 (spare slot), padded = 6, cu[4] = 12
    meta.check_invariants()
    getattr(view, field)[index] = value
    with pytest.raises(InvariantError, match="^padded request slots: " + message):
        meta.check_invariants()


def test_cu_arrays_start_at_zero_and_never_decrease(path):
    """cu[0] = 0 and non-decreasing over [0, padded]; otherwise varlen attention slices
    a negative or shifted span of queries."""
    meta, view = _checked_meta(path)
    _draft(meta, view)
    view.mha_cu_kv_seq_lengths[0] = 1
    with pytest.raises(InvariantError, match=r"^cu arrays: mha_cu_kv_seq_lengths\[0\] = "
                                             r"1 after the last decode forward"):
        meta.check_invariants()

    _commit(meta, view)  # cu_q [0, 3, 7, 9, 12, 12, 12]
    view.mha_cu_query_seq_lengths[2] = 2
    with pytest.raises(InvariantError, match=r"^cu arrays: mha_cu_query_seq_lengths "
                                             r"decreases at slot 2: cu\[1\] = 3 > "
                                             r"cu\[2\] = 2"):
        meta.check_invariants()


def test_commit_pass_cu_total_is_the_padded_token_count(path):
    """After a commit pass, cu_q[padded requests] must equal the padded token count:
    varlen requires q.shape[0] == cu_seqlens_q[-1], or pad rows have no owner."""
    meta, view = _checked_meta(path)
    _commit(meta, view, padded_request_count=3, padded_token_count=9)  # n = padded = 3
    view.mha_cu_query_seq_lengths[3] = 10
    with pytest.raises(InvariantError, match=r"^cu arrays: mha_cu_query_seq_lengths\[3\] "
                                             r"= 10 after the last commit pass, expected "
                                             r"the padded token count 9"):
        meta.check_invariants()


def test_inherited_blocks_are_never_rewritten(path):
    """Tokens in a row's inherited (prefix-cache, ref-counted) blocks must go to the
    dummy block; writing block 0 would corrupt every request sharing it."""
    meta, view = _checked_meta(path)
    _commit(meta, view)
    view.token_to_block_idx[0] = int(TABLE[0, 0])
    with pytest.raises(InvariantError, match=r"^inherited blocks: token 0 \(row 0, block "
                                             r"column 0 < inherited 1\) of the last commit "
                                             r"forward points at block 0, expected "
                                             r"dummy_block_idx 999"):
        meta.check_invariants()


def test_draft_tokens_never_land_in_inherited_blocks(path):
    """A draft depth has no inherited-block redirect. Annotation 2 over table
    [10, 11, 12] (BS 4) means blocks 10 and 11 are shared prefix blocks; a draft at
    position 6 writes block 11 and corrupts every request sharing it. A correct
    scheduler never drafts there, so the checker (and MTPMETA_DEBUG=1, which raises on
    the setup call itself) reports the broken caller. Position 8 (column 2) is fine."""
    meta = make_metadata(path, max_kv_block_count=3)
    view, _ = make_views(meta)
    meta.request_matched_prefix_blocks[0] = 2
    meta.begin_decode(1, 2, [8], [[10, 11, 12]], False)
    meta.setup_decode_step(view)
    meta.check_invariants()
    meta.end_forward()
    meta.begin_decode(1, 2, [6], [[10, 11, 12]], False)
    with pytest.raises(InvariantError, match=r"^inherited blocks: draft token 0 \(draft "
                                             r"row 0 = annotation row 0, block column 1 < "
                                             r"inherited 2\) of the last decode forward "
                                             r"writes shared block 11"):
        meta.setup_decode_step(view)
        meta.check_invariants()


def test_draft_rows_read_the_annotations_of_the_declared_offset(path):
    """Draft row i is active row i, i.e. annotation row paused + i when paused rows come
    first. Row 0 is paused with a 3-block prefix hit; the active request in row 1 has
    none and drafts at position 2. Read against row 0 that draft looks like a write into
    a shared block (a false positive); with draft_annotation_offset = 1 it passes, and a
    real violation is then reported against annotation row 1. The first check keeps the
    counts of its forward: a later row move does not change a passed verdict."""
    meta, view = _checked_meta(path)
    meta.request_matched_prefix_blocks[:2] = torch.tensor([3, 0], dtype=torch.int32)
    meta.draft_annotation_offset = 1
    meta.begin_decode(1, 1, [2], TABLE[1:], False)
    meta.setup_decode_step(view)
    meta.check_invariants()
    meta.move_request_rows([0], [1])  # row 1 now claims 3 blocks: the record is older
    meta.check_invariants()
    meta.end_forward()

    meta.request_matched_prefix_blocks[:2] = torch.tensor([0, 1], dtype=torch.int32)
    meta.begin_decode(1, 1, [2], TABLE[1:], False)
    with pytest.raises(InvariantError, match=r"^inherited blocks: draft token 0 \(draft "
                                             r"row 0 = annotation row 1, block column 0 < "
                                             r"inherited 1\) .* writes shared block 6"):
        meta.setup_decode_step(view)
        meta.check_invariants()


def test_a_draft_offset_with_no_room_for_the_draft_rows_is_named(path):
    meta, view = _checked_meta(path)
    meta.draft_annotation_offset = R  # no room for the one draft row
    meta.begin_decode(1, 1, [2], TABLE[1:], False)
    with pytest.raises(InvariantError, match=r"^inherited blocks: draft_annotation_offset "
                                             r"8 puts the 1 draft rows outside the 8 "):
        meta.setup_decode_step(view)
        meta.check_invariants()


def test_a_draft_record_keeps_the_offset_its_loop_began_with(path):
    """The next step's split (more paused rows) describes the rows as they are now; the
    last step's draft depth is still checked against the rows it drafted."""
    meta, view = _checked_meta(path)
    meta.request_matched_prefix_blocks[:2] = torch.tensor([0, 0], dtype=torch.int32)
    meta.begin_decode(2, 2, [2, 2], TABLE[1:], False)  # no paused rows this step
    meta.setup_decode_step(view)
    meta.end_forward()
    meta.set_request_rows(R - 1, R)  # the next step: R - 1 rows paused
    meta.check_invariants()  # rows 7 and 8 would lie outside the annotations


def _commit_then_draft(meta, view, starts):
    """A scheduler with paused rows first: row 0 paused, rows 1 and 2 active. The commit pass writes
    request 0 (TABLE[1]) positions 0..5 and request 1 (TABLE[2]) 3..6, the pass is
    checked, then a three-deep draft loop from ``starts``; every depth is checked."""
    meta.draft_annotation_offset = 1
    meta.setup_commit_pass(view, [6, 4], TABLE[1:3], start_positions=[0, 3],
                           inherited_blocks=meta.request_matched_prefix_blocks[1:3])
    meta.check_invariants()
    meta.end_forward()
    meta.begin_decode(2, 2, starts, TABLE[1:3], False)
    for _ in range(3):
        meta.setup_decode_step(view)
        meta.check_invariants()
        meta.advance_decode_step()


def test_a_draft_loop_never_overwrites_what_the_commit_pass_before_it_wrote(path):
    """begin_decode given the per-row start positions [2, 6, 7] (row 0 is paused)
    instead of the active requests' start + count [6, 7]: request 0 drafts at 2, into
    block 6 local 2 that the pass just committed, which the check reports. The
    correct starts pass, and so does a loop begun after another view-writing call (only
    the loop right after the pass is compared with it)."""
    meta, view = _checked_meta(path)
    meta.request_matched_prefix_blocks[2] = 1
    _commit_then_draft(meta, view, np.array([6, 7]))
    meta.end_forward()
    per_row = np.array([2, 6, 7])
    with pytest.raises(InvariantError, match=r"^committed KV: draft token 0 \(draft row 0, "
                                             r"position 2\) of the last decode forward "
                                             r"writes block 6 local 2, a slot the commit "
                                             r"pass before this draft loop wrote \(its "
                                             r"token 2\): .*start_positions"):
        _commit_then_draft(meta, view, per_row)

    meta, view = _checked_meta(path)  # the object above still holds the bad depth
    meta.draft_annotation_offset = 1
    meta.setup_commit_pass(view, [6, 4], TABLE[1:3], start_positions=[0, 3])
    meta.check_invariants()
    meta.end_forward()
    meta.write_mha_metadata(view, [1], [1], TABLE[:1], 1)  # a call between: not compared
    meta.begin_decode(2, 2, per_row, TABLE[1:3], False)
    meta.setup_decode_step(view)
    meta.check_invariants()


def test_committed_kv_compares_a_draft_row_with_its_own_request_only(path):
    """Requests that share a block (the scheduler's business, valid input here): the
    commit pass's request 1 commits position 0 of the shared block 10 and draft row 0,
    another request, drafts at position 0 of it. Only the same request's committed
    slots are compared (the state machine found the former false report)."""
    meta, view = _checked_meta(path)
    meta.draft_annotation_offset = 1  # the check runs with paused rows first
    shared = np.full((2, W), 10, dtype=np.int32)
    meta.setup_commit_pass(view, [0, 1], shared, start_positions=[0, 0])
    meta.check_invariants()
    meta.end_forward()
    meta.begin_decode(1, 1, np.array([0]), shared[:1], False)
    meta.setup_decode_step(view)
    meta.check_invariants()  # row 0 committed nothing: no report
    meta.end_forward()
    meta.setup_commit_pass(view, [1, 0], shared, start_positions=[0, 0])
    meta.check_invariants()
    meta.end_forward()
    meta.begin_decode(1, 1, np.array([0]), shared[:1], False)
    with pytest.raises(InvariantError, match=r"^committed KV: draft token 0 "):
        meta.setup_decode_step(view)  # (MTPMETA_DEBUG=1 raises here)
        meta.check_invariants()  # row 0's own committed slot: reported


def test_debug_checks_report_the_overwrite_at_the_draft_depth(path):
    """With the checks installed (what MTPMETA_DEBUG=1 does) the setup call of the
    depth that overwrites committed KV raises; the calls before it pass."""
    debug_cls = type("DebugMTPMetadata", (MTPMetadata,), {})
    install_debug_checks(debug_cls)
    meta = debug_cls(**config())
    meta.allocate("cpu", mirror=(path == "mirror"))
    view, _ = make_views(meta)
    meta.draft_annotation_offset = 1  # row 0 paused
    meta.setup_commit_pass(view, [6, 4], TABLE[1:3], start_positions=[0, 3])
    meta.end_forward()
    meta.begin_decode(2, 2, np.array([2, 6, 7]), TABLE[1:3], False)
    with pytest.raises(InvariantError, match=r"^committed KV: draft token 0 "):
        meta.setup_decode_step(view)


@pytest.mark.parametrize("value", [-1, W + 1])
def test_annotations_stay_within_the_block_table(path, value):
    """A prefix-match count outside [0, W] cannot describe a block-table row."""
    meta, view = _checked_meta(path)
    meta.request_matched_prefix_blocks[2] = value
    with pytest.raises(InvariantError, match=rf"^annotations: request_matched_prefix_"
                                             rf"blocks\[2\] = {value} outside \[0, "
                                             rf"max_kv_block_count {W}\]"):
        meta.check_invariants()


@pytest.mark.parametrize("value", [-1, W * BS + 1])
def test_draft_offsets_stay_within_the_table(path, value):
    """While DRAFT, an offset past the table (or negative) would make the next depth
    write outside the request's blocks."""
    meta, view = _checked_meta(path)
    _draft(meta, view)
    meta.offsets[1] = value
    with pytest.raises(InvariantError, match=rf"^draft offsets: offsets\[1\] = {value} "
                                             rf"\(request 1 of 3\) outside \[0, "):
        meta.check_invariants()
    meta.offsets[1] = 7
    meta.end_forward()
    meta.offsets[1] = value  # stale offsets outside a draft loop are never read
    meta.check_invariants()


def _draft_mode_without_views(meta):
    meta.forward_mode = MTPForwardMode.DRAFT


def _commit_mode_after_a_draft(meta):
    _draft(meta, make_views(meta)[0])
    meta.end_forward()
    meta.forward_mode = MTPForwardMode.COMMIT


def _commit_mode_on_a_fresh_object(meta):
    meta.forward_mode = MTPForwardMode.COMMIT


def _disabled_in_draft(meta):
    meta.enabled = False
    meta.deallocate()
    meta.forward_mode = MTPForwardMode.DRAFT


def _disabled_with_buffers(meta):
    meta.enabled = False


def _unallocated_with_buffers(meta):
    meta._backend = None  # corrupt: buffers without a backend


@pytest.mark.parametrize("corrupt, message", [
    (_draft_mode_without_views, r"DRAFT needs the active views"),
    (_commit_mode_after_a_draft, r"COMMIT is entered by setup_commit_pass \(writer calls "
                                 r"may follow it\), but the last view-writing call was "
                                 r"'decode'"),
    (_commit_mode_on_a_fresh_object, r"COMMIT is entered by setup_commit_pass .* was None"),
    (_disabled_in_draft, r"a disabled object must stay NONE, found DRAFT"),
    (_disabled_with_buffers, r"a disabled object must hold no buffers"),
    (_unallocated_with_buffers, r"an unallocated object must hold no buffers"),
])
def test_forward_mode_agrees_with_the_call_sequence(path, corrupt, message):
    """The mode decides the attention kernel: DRAFT without staged views, COMMIT that no
    commit pass entered, or a disabled object in a forward would launch on stale state."""
    meta, _ = _checked_meta(path)
    corrupt(meta)
    with pytest.raises(InvariantError, match="^forward mode: " + message):
        meta.check_invariants()


# --------------------------------------------------------------------- debug checks
@debug_env_off
def test_debug_wrapper_checks_after_each_public_call_once(path):
    """install_debug_checks on a subclass: the next public call after a corruption
    raises; a call that raises on its own keeps its own exception; properties and
    check_invariants are left alone; the base class is untouched."""
    debug_cls = type("DebugMTPMetadata", (MTPMetadata,), {})
    install_debug_checks(debug_cls)
    install_debug_checks(debug_cls)  # idempotent: no double wrapping
    assert debug_cls.begin_decode.__wrapped__ is MTPMetadata.begin_decode
    assert not hasattr(MTPMetadata.begin_decode, "__wrapped__")
    assert debug_cls.check_invariants is MTPMetadata.check_invariants
    assert isinstance(vars(MTPMetadata)["offsets"], property)
    assert "offsets" not in vars(debug_cls)

    meta = debug_cls(**config())
    meta.allocate("cpu", mirror=(path == "mirror"))  # nested invalidate: checked once
    view, _ = make_views(meta)
    _commit(meta, view)
    meta.end_forward()
    meta.move_request_rows([2], [1])
    _draft(meta, view)
    view.token_to_block_idx[3] = 5
    with pytest.raises(ChunkCarryError):
        meta.take_chunk_boundary(1, 2)  # its own error, not the invariant's
    with pytest.raises(InvariantError, match="padded token rows: token 3"):
        meta.advance_decode_step()


def test_meta_device_objects_are_skipped_by_the_wrapper_and_refused_by_the_check():
    """Buffers on torch's meta device (a host-cost bench) hold no values: the debug
    wrapper runs their calls unchecked (they would fail reading a meta tensor back),
    and an explicit check is a ValueError saying why."""
    from mtpmeta.bench.meta_device import cpp_meta_kernels

    debug_cls = type("DebugMTPMetadata", (MTPMetadata,), {})
    install_debug_checks(debug_cls)
    meta = debug_cls(**config())
    meta.allocate(torch.device("meta"), mirror=True)
    starts = torch.zeros(R, dtype=torch.int64, device="meta")
    with cpp_meta_kernels():
        meta.begin_decode(3, 4, starts, torch.tensor(TABLE), True)
        meta.advance_decode_step()
        meta.end_forward()
    with pytest.raises(ValueError, match="check_invariants: the buffers are on torch's "
                                         "meta device"):
        meta.check_invariants()


_DEBUG_SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from mtpmeta import ContextGPUView, InvariantError, MTPMetadata
    print("WRAPPED", hasattr(MTPMetadata.advance_decode_step, "__wrapped__"))
    for path in ("direct", "mirror"):
        meta = MTPMetadata(enabled=True, max_requests=8, max_kv_block_count=6,
                           block_size_tokens=4, dummy_block_idx=999,
                           block_table_dtype=torch.int32, hidden_size=8,
                           hidden_dtype=torch.float32)
        meta.allocate("cpu", mirror=path == "mirror")
        view = ContextGPUView(8, 64, 6)
        table = np.arange(48, dtype=np.int32).reshape(8, 6)
        meta.request_matched_prefix_blocks[:3] = torch.tensor([1, 0, 2], dtype=torch.int32)
        meta.setup_commit_pass(view, [3, 4, 2], table, start_positions=[0, 2, 5],
                               inherited_blocks=meta.request_matched_prefix_blocks,
                               padded_token_count=12)
        meta.end_forward()
        meta.move_request_rows([2], [1])
        meta.begin_decode(3, 5, np.array([5, 9, 13]), table, False)
        meta.setup_decode_step(view)
        view.token_to_block_idx[4] = 7  # corrupt a pad row between two calls
        try:
            meta.advance_decode_step()
        except InvariantError as exc:
            print(path, "RAISED", exc)
        else:
            print(path, "CLEAN")
""")


@pytest.mark.parametrize("debug", [True, False])
def test_mtpmeta_debug_env_checks_after_every_public_call(debug):
    """With MTPMETA_DEBUG=1 (and under python -O, which strips asserts) a view corrupted
    between two calls makes the NEXT public call raise; the valid calls before it,
    a row move after a commit pass with live annotations included, pass. Without the
    variable the methods are not wrapped and nothing is checked."""
    env = {k: v for k, v in os.environ.items() if k != "MTPMETA_DEBUG"}
    if debug:
        env["MTPMETA_DEBUG"] = "1"
    out = subprocess.run([sys.executable, "-O", "-c", _DEBUG_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"WRAPPED {debug}"
    for path, line in zip(("direct", "mirror"), lines[1:]):
        if debug:
            assert line.startswith(f"{path} RAISED padded token rows: token 4 (pad rows "
                                   "[3, 5) of the last decode forward) has "
                                   "token_to_block_idx 7"), line
        else:
            assert line == f"{path} CLEAN"
