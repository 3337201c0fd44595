"""The default route on wide tables on CUDA (``mtpmeta/mirror/counted.py``, "Derived
counts"): production-geometry tables (R 1024, W 2048, and W 512 where the rows use
most of the width) are read once and written by their used columns; a commit pass ships
packed rows and the device rows get -1 past them. Skipped without CUDA.

Failure stories: the -1 columns past ``C`` left unwritten on the device (a stale block
read by the next forward), a packed copy placed at the wrong row stride, a hidden sync
in the wide calls, and a wide call launching more than its budget. The oracle is the
reference on CUDA, replaying the same trace steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta.bench.trace import PRODUCTION_TRACE, make_trace  # noqa: E402
from mtpmeta.bench.trace_replay import Replay  # noqa: E402
from mtpmeta.bench.variants import state_of  # noqa: E402
from tests.gpu.test_cuda_launches import _device_activity  # noqa: E402

CUDA = torch.device("cuda")
STEPS = 8


@pytest.mark.parametrize("width", [2048, 512])
def test_production_trace_steps_match_the_reference_on_cuda(width):
    """Every step of the production trace's first ``STEPS`` (engine order, draft depths
    eager): the view and the persistent buffers equal the reference's, and every
    begin took the wide route. At W 2048 the commit passes pack at C = 1024; at W 512
    their rows use most of the width and pack at C = W."""
    config = dataclasses.replace(PRODUCTION_TRACE, block_columns=width)
    trace = make_trace(config, STEPS)
    ours = Replay("mirror", config, CUDA)
    ref = Replay("reference", config, CUDA)
    packed = 0
    for index, step in enumerate(trace):
        for replay in (ours, ref):
            replay.prepare(index, step)
            replay.run(step)
        packed += ours.meta._backend.begin_derived
        torch.cuda.synchronize()
        expected = state_of(ref.meta, ref.view)
        for key, value in state_of(ours.meta, ours.view).items():
            assert torch.equal(value, expected[key].to(value.dtype)), (index, key)
    assert packed == STEPS


def _calls(replay: Replay, index: int, step):
    """``(commit, begin)``: the step's wide calls on ``replay``'s table."""
    replay.prepare(index, step)
    meta, view, table = replay.meta, replay.view, replay.table

    def commit():
        meta.setup_commit_pass(view, step.append_counts, table,
                               start_positions=step.commit_starts,
                               inherited_blocks=step.inherited,
                               padded_token_count=step.padded_tokens,
                               padded_request_count=step.padded_requests)
        meta.end_forward()

    def begin():
        meta.begin_decode(step.active, step.padded, step.start_positions, table, True)

    return commit, begin


def test_packed_calls_launch_within_budget_and_never_sync():
    """A wide commit pass and begin never sync (``set_sync_debug_mode("error")``); a
    wide begin launches at most 4 kernels or copies (head, packed rows, their
    placement, -1 past ``C``) and a wide commit pass at most 4 (the op budgets)."""
    trace = make_trace(PRODUCTION_TRACE, 5)
    ours = Replay("mirror", PRODUCTION_TRACE, CUDA)
    for index, step in enumerate(trace[:3]):
        ours.prepare(index, step)
        ours.run(step)
    commit, begin = _calls(ours, 3, trace[3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        commit()
        begin()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ours.meta._backend.begin_derived
    ours.meta.end_forward()
    commit, begin = _calls(ours, 4, trace[4])
    launches = (_device_activity(commit), _device_activity(begin))
    if launches == (0, 0):
        pytest.skip("the profiler recorded no CUDA activity (CUPTI not permitted?)")
    assert 0 < launches[0] <= 4 and 0 < launches[1] <= 4, launches
