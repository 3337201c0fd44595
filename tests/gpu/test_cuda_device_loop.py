"""The device-input draft loop (``mtpmeta.mirror.device_draft_plan``) on CUDA. Skipped without CUDA.

The CPU tests count dispatches; here the profiler counts launches, the caching
allocator counts allocations and sync debug mode catches a sync. Failure stories: a
planned depth whose ``_foreach_copy_`` falls back to one copy per pair, a strided
``cumsum`` staging through a temporary at every begin, a sync hidden in the plan, or
CUDA results that differ from the reference's.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import VIEW_FIELDS, ContextGPUView, MTPMetadata  # noqa: E402
from mtpmeta.bench.workload import StepConfig, make_steps  # noqa: E402
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata  # noqa: E402
from tests.gpu.test_cuda_launches import _device_activity  # noqa: E402
from tests.upstream_view import UpstreamLayoutView  # noqa: E402

CONFIG = StepConfig()
CUDA = torch.device("cuda")


def _objects(layout):
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    meta.allocate(CUDA, mirror=True, max_tokens=CONFIG.max_tokens)
    view = layout(CONFIG.max_requests, CONFIG.max_tokens, CONFIG.block_columns, CUDA)
    return meta, view


def _loop(meta, view, inputs, n, padded):
    meta.begin_decode(n, padded, inputs.start_positions.to(CUDA),
                      inputs.block_table.to(CUDA), False)
    for _ in range(CONFIG.depths):
        meta.setup_decode_step(view)
        meta.advance_decode_step()
    meta.end_forward()


@pytest.mark.parametrize("layout", [ContextGPUView, UpstreamLayoutView],
                         ids=["mtpmeta", "upstream"])
def test_device_input_loop_matches_the_reference_on_cuda(layout):
    meta, view = _objects(layout)
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    ref_view = ReferenceGPUView(CONFIG.max_requests, CONFIG.max_tokens,
                                CONFIG.block_columns, CUDA)
    for index, inputs in enumerate(make_steps(CONFIG, 4, seed=0)):
        n, padded = CONFIG.active - 3 * index, CONFIG.padded_active
        starts, table = inputs.start_positions.to(CUDA), inputs.block_table.to(CUDA)
        meta.begin_decode(n, padded, starts, table, False)
        ref.begin_decode(n, padded, starts, table, False)
        for _ in range(CONFIG.depths):
            meta.setup_decode_step(view)
            ref.setup_decode_step(ref_view)
            for f in VIEW_FIELDS:
                assert torch.equal(getattr(view, f.name).cpu().long(),
                                   getattr(ref_view, f.name).cpu().long()), f.name
            meta.advance_decode_step()
            ref.advance_decode_step()
        meta.end_forward()
        ref.end_forward()
        assert torch.equal(meta.offsets.cpu(), ref.offsets.cpu())


@pytest.mark.parametrize("layout", [ContextGPUView, UpstreamLayoutView],
                         ids=["mtpmeta", "upstream"])
def test_device_input_loop_launches_allocates_and_syncs_within_budget(layout):
    """After warm-up loops: begin <= 12 launches, a planned depth <= 3, no sync, and no
    allocation from the caching allocator across a whole loop."""
    meta, view = _objects(layout)
    steps = make_steps(CONFIG, 3, seed=0)
    for inputs in steps:
        _loop(meta, view, inputs, CONFIG.active, CONFIG.padded_active)
    inputs = steps[1]
    starts, table = inputs.start_positions.to(CUDA), inputs.block_table.to(CUDA)
    begin = _device_activity(lambda: meta.begin_decode(
        CONFIG.active, CONFIG.padded_active, starts, table, False))
    depth = _device_activity(lambda: meta.setup_decode_step(view))
    meta.end_forward()
    if begin == 0 or depth == 0:
        pytest.skip("the profiler recorded no CUDA activity (CUPTI not permitted?)")
    assert begin <= 12 and depth <= 3, (begin, depth)
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.begin_decode(CONFIG.active, CONFIG.padded_active, starts, table, False)
        for _ in range(CONFIG.depths):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations


@pytest.mark.parametrize("layout", [ContextGPUView, UpstreamLayoutView],
                         ids=["mtpmeta", "upstream"])
def test_device_route_token_writer_matches_the_reference_and_allocates_nothing(layout):
    """The drop-in's draft loop calls write_token_maps with device tensors at every
    depth: after the view's first call it writes the reference's fields with no sync
    and no allocation from the caching allocator (``TokenScratch``, out= ops only)."""
    meta, view = _objects(layout)
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    ref_view = ReferenceGPUView(CONFIG.max_requests, CONFIG.max_tokens,
                                CONFIG.block_columns, CUDA)
    g = torch.Generator().manual_seed(3)
    R, W, BS = CONFIG.max_requests, CONFIG.block_columns, CONFIG.block_size

    def inputs(T):
        rows = torch.randint(0, R, (T,), generator=g).to(CUDA)
        positions = torch.randint(0, W * BS, (T,), generator=g, dtype=torch.int32).to(CUDA)
        table = torch.randint(0, 500, (R, W), generator=g, dtype=torch.int32).to(CUDA)
        return rows, positions, table

    for T in (40, 57):
        rows, positions, table = inputs(T)
        meta.write_token_maps(view, rows, positions, table, T + 3)
        ref.write_token_maps(ref_view, rows, positions, table, T + 3)
        for f in VIEW_FIELDS:
            if f.per_token:
                assert torch.equal(getattr(view, f.name)[:T + 3].cpu().long(),
                                   getattr(ref_view, f.name)[:T + 3].cpu().long()), f.name
    rows, positions, table = inputs(57)
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.write_token_maps(view, rows, positions, table, 60)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
