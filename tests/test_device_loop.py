"""The device-input draft loop planned at ``begin_decode`` (``mtpmeta.mirror.device_draft_plan``).

With device start positions the mirror path plans the loop's first ``PLANNED_DEPTHS``
depths in a few batched ops at the begin, and each depth places its planned row with
one ``_foreach_copy_``. Failure stories: a depth places the wrong row (setup twice,
advance without setup, a new begin mid-loop), a view change or a view of other dtypes
gets stale or mis-typed data, a depth past the plan is wrong, or the op counts creep
back to the ~28 per depth of the unplanned route. Every comparison is against the
reference (upstream's op sequence) after every call.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtpmeta import ContextGPUView
from mtpmeta.bench.counters import OpCounter
from mtpmeta.buffers.persistent import PLANNED_DEPTHS
from mtpmeta.reference import ReferenceGPUView
from tests.helpers import assert_buffers_equal, assert_views_equal, make_metadata, \
    make_reference
from tests.upstream_view import UpstreamLayoutView

pytestmark = pytest.mark.usefixtures("device_route")

# A geometry where a loop of PLANNED_DEPTHS + 3 depths stays inside the table.
GEOMETRY = dict(max_requests=12, max_kv_block_count=8, block_size_tokens=4,
                dummy_block_idx=999)
LIMIT = 8 * 4  # W * BS
VIEWS = {"context": ContextGPUView, "upstream": UpstreamLayoutView}


def _setup(view_kind="context", **overrides):
    kwargs = {**GEOMETRY, **overrides}
    meta = make_metadata("mirror", **kwargs)
    ref = make_reference(**kwargs)
    R, W = meta.max_requests, meta.max_kv_block_count
    return meta, ref, VIEWS[view_kind](R, 64, W, "cpu"), ReferenceGPUView(R, 64, W, "cpu")


def _inputs(rng, meta, depths):
    R, W = meta.max_requests, meta.max_kv_block_count
    starts = torch.tensor(rng.integers(0, LIMIT - depths, R), dtype=torch.int32)
    table = torch.tensor(rng.integers(-1, 500, (R, W)), dtype=torch.int32)
    return starts, table


def _begin(meta, ref, rng, n, padded, depths=PLANNED_DEPTHS):
    starts, table = _inputs(rng, meta, depths)
    meta.begin_decode(n, padded, starts, table, False)
    ref.begin_decode(n, padded, starts, table, False)
    assert_buffers_equal(meta, ref)
    # The planned begin's scan writes draft_count (contract §12's real count) last.
    assert meta._buffers.draft_count.tolist() == [n]


def _depth(meta, ref, view, ref_view):
    shape = meta.setup_decode_step(view)
    ref.setup_decode_step(ref_view)
    assert shape.max_seqlen_k is None  # eager, device start positions: unknown
    assert_views_equal(view, ref_view)
    assert_buffers_equal(meta, ref)


def _advance(meta, ref):
    meta.advance_decode_step()
    ref.advance_decode_step()
    assert_buffers_equal(meta, ref)


@pytest.mark.parametrize("view_kind", sorted(VIEWS))
def test_planned_loops_match_the_reference_at_every_depth(rng, view_kind):
    """Random loops (n 0..R, padded n..R, start positions, tables with -1 entries):
    every depth's view and every buffer equal the reference's."""
    meta, ref, view, ref_view = _setup(view_kind)
    R = meta.max_requests
    for _ in range(12):
        n = int(rng.integers(0, R + 1))
        padded = int(rng.integers(n, R + 1))
        _begin(meta, ref, rng, n, padded)
        for _ in range(int(rng.integers(1, PLANNED_DEPTHS + 1))):
            _depth(meta, ref, view, ref_view)
            _advance(meta, ref)
        meta.end_forward()
        ref.end_forward()


def test_shrinking_and_growing_loops_keep_every_sum_and_the_count(rng):
    """Loops whose n falls, rises and falls again under padded counts both above and
    below the older loops' n (the scan input past n must be zero for the pad sums and
    for draft_count): every depth and draft_count equal the reference's."""
    meta, ref, view, ref_view = _setup()
    R = meta.max_requests
    for n, padded in [(R, R), (3, R), (2, 2), (R - 1, R), (0, 5), (R - 4, R - 4), (1, 1),
                      (6, R), (6, 6), (5, R)]:
        _begin(meta, ref, rng, n, padded)
        for _ in range(2 if n else 0):  # (n = 0: the host knows every length)
            _depth(meta, ref, view, ref_view)
            _advance(meta, ref)
        meta.end_forward()
        ref.end_forward()


def test_setup_twice_and_advance_without_setup(rng):
    """A depth is the number of advances since the begin, whatever the setups: a
    repeated setup places the same depth, an advance without a setup skips one."""
    meta, ref, view, ref_view = _setup()
    _begin(meta, ref, rng, 7, 10)
    _depth(meta, ref, view, ref_view)
    _depth(meta, ref, view, ref_view)  # again, no advance
    _advance(meta, ref)
    _advance(meta, ref)  # no setup in between
    _advance(meta, ref)
    _depth(meta, ref, view, ref_view)
    _depth(meta, ref, view, ref_view)


def test_view_changes_between_depths(rng):
    """Depths alternate between views of both layouts (int32 and int64 block ids):
    each view holds its depth's values, across loops whose plan follows the last
    view's block dtype."""
    meta, ref, _, _ = _setup()
    R, W = meta.max_requests, meta.max_kv_block_count
    views = [(ContextGPUView(R, 64, W, "cpu"), ReferenceGPUView(R, 64, W, "cpu")),
             (UpstreamLayoutView(R, 64, W, "cpu"), ReferenceGPUView(R, 64, W, "cpu"))]
    for loop in range(3):
        _begin(meta, ref, rng, 9 - loop, 11)
        for depth in range(4):
            view, ref_view = views[(depth + loop) % 2]
            _depth(meta, ref, view, ref_view)
            _advance(meta, ref)


def test_depths_past_the_plan_and_a_new_begin_mid_loop(rng):
    """Depths beyond PLANNED_DEPTHS take the per-depth route, still exact; a begin in
    the middle of a loop plans the new loop from its depth 0."""
    meta, ref, view, ref_view = _setup()
    _begin(meta, ref, rng, 8, 12, depths=PLANNED_DEPTHS + 3)
    for _ in range(PLANNED_DEPTHS + 3):
        _depth(meta, ref, view, ref_view)
        _advance(meta, ref)
    _begin(meta, ref, rng, 5, 8)
    _depth(meta, ref, view, ref_view)
    _advance(meta, ref)
    _begin(meta, ref, rng, 6, 6)  # mid-loop, before its depth 1
    _depth(meta, ref, view, ref_view)
    _advance(meta, ref)
    _depth(meta, ref, view, ref_view)


def test_host_route_between_device_loops(rng):
    """A host-input loop between two device-input loops: each loop is exact."""
    meta, ref, view, ref_view = _setup()
    _begin(meta, ref, rng, 6, 8)
    _depth(meta, ref, view, ref_view)
    starts, table = _inputs(rng, meta, 3)
    meta.begin_decode(5, 8, starts.numpy(), table.numpy(), False)
    ref.begin_decode(5, 8, starts, table, False)
    meta.setup_decode_step(view)  # the host route (its shape knows max_seqlen_k)
    ref.setup_decode_step(ref_view)
    assert_views_equal(view, ref_view)
    _advance(meta, ref)
    _begin(meta, ref, rng, 7, 9)
    _depth(meta, ref, view, ref_view)
    _advance(meta, ref)
    _depth(meta, ref, view, ref_view)


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: check_invariants refuses the out-of-table offsets")
def test_out_of_table_positions_go_to_the_dummy_block():
    """Device values are not checked: a start position past the table or negative
    sends its token to D at every planned depth (never to a real block), with the
    local offset and positions upstream's formulas give."""
    meta, _, view, _ = _setup()
    R, W, BS = meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    starts = torch.tensor([LIMIT - 1, LIMIT + 5, -6, 0] + [0] * (R - 4), dtype=torch.int32)
    meta.begin_decode(4, 4, starts, table, False)
    for depth in range(3):
        meta.setup_decode_step(view)
        positions = starts[:4] + depth
        columns = torch.div(positions, BS, rounding_mode="floor")
        inside = (columns >= 0) & (columns < W)
        expected = torch.where(inside, table[torch.arange(4), columns.clamp(0, W - 1)],
                               torch.tensor(meta.dummy_block_idx, dtype=torch.int32))
        assert view.token_to_block_idx[:4].tolist() == expected.tolist()
        assert view.token_to_local_position_within_kv_block[:4].tolist() == \
            (positions % BS).tolist()
        assert view.token_to_pos_ids[:4].tolist() == positions.tolist()
        meta.advance_decode_step()


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: check_invariants refuses the out-of-table offsets")
@pytest.mark.parametrize("view_kind", sorted(VIEWS))
@pytest.mark.parametrize("block_size", [4, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_planned_depths_take_the_int32_offsets_of_any_start(view_kind, block_size, dtype):
    """int64 start positions the int32 ``offsets`` wrap (past 2**31, below -2**31, a
    sum offsets + d that overflows int32), negative, -1 and out-of-table ones, strided
    too: at every planned depth each token map is upstream's formula on the int32
    position ``offsets + d`` (block D outside the table, Python's ``%`` for the local
    offset, the int32 position widened for the position id), with a block size that
    does not divide 2**32 as well; the offsets, lengths and sums equal the reference's."""
    meta, ref, view, ref_view = _setup(view_kind, block_size_tokens=block_size)
    R, W = meta.max_requests, meta.max_kv_block_count
    D = meta.dummy_block_idx
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    wide = [2 ** 31 + 5, -2 ** 31 - 3, 2 ** 40 + 7, -2 ** 40 - 1] if dtype == torch.int64 \
        else []
    values = wide + [2 ** 31 - 3, -2 ** 31, -1, -6, block_size * W - 2, 7]
    n = len(values)
    spaced = torch.zeros(2 * R, dtype=torch.int64)  # every other entry: a strided input
    spaced[:2 * n:2] = torch.tensor(values)
    for starts in (torch.tensor(values + [0] * (R - n)).to(dtype), spaced[::2].to(dtype)):
        meta.begin_decode(n, n + 1, starts, table, False)
        ref.begin_decode(n, n + 1, starts, table, False)
        assert_buffers_equal(meta, ref)  # the offsets: the int32 bits of the starts
        offsets = ref.offsets[:n].clone()
        for depth in range(PLANNED_DEPTHS):
            meta.setup_decode_step(view)
            positions = offsets + depth  # int32, wrapping as upstream's add does
            columns = torch.div(positions, block_size, rounding_mode="floor")
            inside = (columns >= 0) & (columns < W)
            expected = torch.where(inside, table[torch.arange(n), columns.clamp(0, W - 1)],
                                   torch.tensor(D, dtype=torch.int32))
            assert view.token_to_block_idx[:n].tolist() == expected.tolist(), depth
            assert view.token_to_local_position_within_kv_block[:n].tolist() == \
                (positions % block_size).tolist(), depth
            assert view.token_to_pos_ids[:n].tolist() == positions.tolist(), depth
            assert view.token_to_position_in_request[:n].tolist() == positions.tolist()
            assert view.mha_kv_seq_lengths[:n].tolist() == (positions + 1).tolist()
            assert view.token_to_block_idx[n].item() == D
            ref.stage_decode_lengths()
            meta.advance_decode_step()
            ref.advance_decode_step()
            assert_buffers_equal(meta, ref)
        meta.end_forward()
        ref.end_forward()


# ------------------------------------------------------------------------ op counts
def _standard_step_objects(view_kind):
    """``(config, meta, view, steps)``: a mirror object, a view and 3 standard steps."""
    from mtpmeta.bench.workload import StepConfig, make_steps

    config = StepConfig()
    meta = make_metadata("mirror", **{k: v for k, v in config.metadata_kwargs().items()
                                     if k != "enabled"})
    view = VIEWS[view_kind](config.max_requests, config.max_tokens, config.block_columns,
                            "cpu")
    return config, meta, view, make_steps(config, 3, seed=0)


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: the invariant checks issue torch ops")
@pytest.mark.parametrize("view_kind", sorted(VIEWS))
@pytest.mark.parametrize("n,padded", [(192, 192), (190, 192)], ids=["full", "pad"])
def test_device_input_loop_op_budget(view_kind, n, padded):
    """On the standard geometry with device inputs (after a warm-up loop on the view):
    begin_decode 7 device data ops and 2 views (the inputs' rows), each planned depth
    1 (one _foreach_copy_: every pair of one word dtype, none converted), each advance
    1; no read-back and no new storage anywhere (the whole step's count: the next test)."""
    config, meta, view, steps = _standard_step_objects(view_kind)
    counts = {"begin": [], "depth": [], "advance": []}
    for index, inputs in enumerate(steps):  # loop 0 learns the view's dtypes, loop 1
        # plans in them (and fills the padded table's D columns in them, once)
        with OpCounter() as begin:
            meta.begin_decode(n, padded, inputs.start_positions, inputs.block_table,
                              False)
        counts["begin"].append(begin)
        for _ in range(config.depths):
            with OpCounter() as depth:
                meta.setup_decode_step(view)
            with OpCounter() as advance:
                meta.advance_decode_step()
            if index == 2:
                counts["depth"].append(depth)
                counts["advance"].append(advance)
        meta.end_forward()
    every = counts["begin"] + counts["depth"] + counts["advance"]
    assert all(c.scalar_reads == 0 and c.new_storages == 0 for c in every)
    assert counts["begin"][2].data_ops == 7, counts["begin"][2].ops
    assert counts["begin"][2].ops["aten::cumsum"] == 1  # every sum and draft_count
    # Its only views slice the caller's two inputs; its own are built once per n.
    assert counts["begin"][2].view_ops == 2, counts["begin"][2].ops
    assert [c.data_ops for c in counts["depth"]] == [1] * config.depths, \
        [c.ops for c in counts["depth"]]
    assert all(c.ops["aten::_foreach_copy_"] == 1 for c in counts["depth"])
    assert [c.data_ops for c in counts["advance"]] == [1] * config.depths
    # A loop with fewer real rows zeroes the older loop's scan input past them (one op
    # more, for the sums and draft_count), once.
    inputs = steps[0]
    for expected in (8, 7):
        with OpCounter() as begin:
            meta.begin_decode(n - 1, padded, inputs.start_positions, inputs.block_table,
                              False)
        assert begin.data_ops == expected, begin.ops


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="MTPMETA_DEBUG=1: the invariant checks issue torch ops")
@pytest.mark.parametrize("view_kind", sorted(VIEWS))
def test_device_input_standard_step_meets_the_host_routes_step_budget(view_kind):
    """With device inputs the whole standard step (rows, carry, the
    draft loop on device start positions and table, then the commit pass on host
    inputs, as in the bench's device-input trace) stays within the budget the host
    route is held to (``test_op_budget.STEP_BUDGET``: 16 device data ops, its 3
    advances not counted; 3 per depth): every call is counted here, none assumed. It
    takes 13, and 16 with the advances; no read-back and no new storage."""
    from mtpmeta.bench.counters import counted_step
    from tests.test_op_budget import BUDGET, STEP_BUDGET

    config, meta, view, steps = _standard_step_objects(view_kind)
    for inputs in steps:  # steps 0 and 1 warm the view's plans; step 2 is counted
        calls = counted_step(meta, view, inputs, config, commit_inputs=inputs.as_numpy())
    every = [c for counters in calls.values() for c in counters]
    assert all(c.scalar_reads == 0 and c.new_storages == 0 for c in every), \
        [c.ops for c in every if c.scalar_reads or c.new_storages]
    assert all(c.data_ops <= BUDGET["depth"] for c in calls["depth"])
    ops = {name: sum(c.data_ops for c in counters) for name, counters in calls.items()}
    step = sum(count for name, count in ops.items() if name != "advance")
    assert step <= STEP_BUDGET, ops
    assert (step, ops["advance"]) == (13, config.depths), ops  # this design's count


def test_captured_loop_begin_with_device_inputs_plans_nothing(rng):
    """begin_decode(..., capture_setup=True) with device inputs copies the inputs and
    the device count (3 ops) and plans nothing: its depths are the captured route's."""
    meta, _, _, _ = _setup()
    starts, table = _inputs(rng, meta, 3)
    with OpCounter() as counter:
        meta.begin_decode(5, 8, starts, table, True, capture_setup=True)
    assert counter.data_ops == 3, counter.ops
    assert meta._backend.device_route.plan.valid is False
