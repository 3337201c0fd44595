"""GPU integration tests of the mirror path. Skipped without CUDA.

Failure stories: a sync hidden in the draft loop (caught by sync debug mode), a captured
draft depth that replays against stale addresses, and a pinned staging slot rewritten
while its async copy is still queued behind slow GPU work.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import VIEW_FIELDS, ContextGPUView, MTPMetadata  # noqa: E402
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata  # noqa: E402
from mtpmeta.workload import StepConfig, make_steps, run_commit, run_step  # noqa: E402

CONFIG = StepConfig(max_requests=64, block_columns=32, block_size=16, active=48,
                    prefill_tokens=64, inherited_blocks=2, moves=8, swaps=2, resets=8)
CUDA = torch.device("cuda")


def _pair():
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    meta.allocate(CUDA)
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    view = ContextGPUView(CONFIG.max_requests, CONFIG.max_tokens, CONFIG.block_columns, CUDA)
    ref_view = ReferenceGPUView(CONFIG.max_requests, CONFIG.max_tokens,
                                CONFIG.block_columns, CUDA)
    return meta, view, ref, ref_view


def _assert_views_equal(view, ref_view):
    torch.cuda.synchronize()
    for f in VIEW_FIELDS:
        assert torch.equal(getattr(view, f.name).cpu(), getattr(ref_view, f.name).cpu()), f.name


def test_mirror_path_matches_reference_on_cuda():
    meta, view, ref, ref_view = _pair()
    assert meta.mirror is True
    for inputs in make_steps(CONFIG, 4, seed=11):
        run_step(meta, view, inputs, CONFIG)
        run_step(ref, ref_view, inputs, CONFIG)
        _assert_views_equal(view, ref_view)
        for name in ("offsets", "block_table", "query_lengths", "kv_lengths"):
            assert torch.equal(getattr(meta, name).cpu(), getattr(ref, name).cpu()), name
        assert torch.equal(meta.request_matched_prefix_blocks, ref.request_matched_prefix_blocks)


def test_draft_loop_and_commit_pass_make_no_sync():
    meta, view, _, _ = _pair()
    steps = make_steps(CONFIG, 3, seed=12)
    run_step(meta, view, steps[0], CONFIG)  # warm caches and JIT
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inputs in steps[1:]:
            meta.begin_decode(CONFIG.active, CONFIG.active, inputs.start_positions,
                              inputs.block_table, False)
            for _ in range(CONFIG.depths):
                meta.setup_decode_step(view)
                meta.stage_decode_lengths()
                meta.advance_decode_step()
            meta.end_forward()
            run_commit(meta, view, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_captured_draft_depth_replays_new_begin_decode_data():
    """Capture setup_decode_step + advance_decode_step once; replay it for several
    steps after fresh begin_decode(graphed=True) calls; compare with eager results."""
    meta, view, ref, ref_view = _pair()
    n = CONFIG.active
    meta.begin_decode_for_capture(n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture
            meta.setup_decode_step(view)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    meta.begin_decode_for_capture(n)
    with torch.cuda.graph(graph):
        meta.setup_decode_step(view)
        meta.advance_decode_step()
    meta.end_forward()
    for inputs in make_steps(CONFIG, 3, seed=13):
        meta.begin_decode(n, n, inputs.start_positions.to(CUDA),
                          inputs.block_table.to(CUDA), True)
        ref.begin_decode(n, n, inputs.start_positions.to(CUDA), inputs.block_table.to(CUDA),
                         True)
        for _ in range(CONFIG.depths):
            graph.replay()
            ref.setup_decode_step(ref_view)
            ref.advance_decode_step()
            _assert_views_equal(view, ref_view)
        meta.end_forward()
        ref.end_forward()


def test_pinned_staging_survives_slow_stream_and_rapid_restaging():
    """Queue slow GPU work, then restage many forwards faster than the copies can run;
    every forward's snapshot must still hold its own data."""
    meta, view, ref, ref_view = _pair()
    generator = torch.Generator().manual_seed(14)
    rounds = 24
    snapshots = torch.zeros((rounds, 4, CONFIG.max_tokens), dtype=torch.int32, device=CUDA)
    expected = []
    table = torch.randint(0, 1000, (CONFIG.max_requests, CONFIG.block_columns),
                          generator=generator, dtype=torch.int32)
    torch.cuda._sleep(50_000_000)  # keep the stream busy while the host races ahead
    for i in range(rounds):
        T = 32
        rows = torch.randint(0, CONFIG.max_requests, (T,), generator=generator)
        positions = torch.randint(0, CONFIG.block_columns * CONFIG.block_size, (T,),
                                  generator=generator)
        meta.write_token_maps(view, rows, positions, table, T + 8)
        for k, name in enumerate(("token_to_block_idx", "token_to_local_position_within_kv_block",
                                  "token_to_request_idx", "token_to_position_in_request")):
            snapshots[i, k].copy_(getattr(view, name)[:CONFIG.max_tokens], non_blocking=True)
        ref.write_token_maps(ref_view, rows.to(CUDA), positions.to(CUDA), table.to(CUDA), T + 8)
        expected.append(torch.stack([getattr(ref_view, name)[:CONFIG.max_tokens].clone()
                                     for name in ("token_to_block_idx",
                                                  "token_to_local_position_within_kv_block",
                                                  "token_to_request_idx",
                                                  "token_to_position_in_request")]))
    torch.cuda.synchronize()
    for i in range(rounds):
        assert torch.equal(snapshots[i, :, :40].cpu(), expected[i][:, :40].cpu()), i


def test_device_tensor_inputs_match_reference_on_cuda():
    """Writers fed CUDA tensors (as upstream call sites do) take the device-op route
    and give the reference's results, with no sync."""
    meta, view, ref, ref_view = _pair()
    generator = torch.Generator().manual_seed(15)
    limit = CONFIG.block_columns * CONFIG.block_size
    table = torch.randint(0, 1000, (CONFIG.max_requests, CONFIG.block_columns),
                          generator=generator, dtype=torch.int32).to(CUDA)
    rows = torch.randint(0, CONFIG.max_requests, (40,), generator=generator).to(CUDA)
    positions = torch.randint(0, limit, (40,), generator=generator).to(CUDA)
    inherited = torch.randint(0, 3, (CONFIG.max_requests,), generator=generator).to(CUDA)
    lengths = torch.randint(1, 9, (CONFIG.active,), generator=generator,
                            dtype=torch.int32).to(CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.write_token_maps(view, rows, positions, table, 48, inherited)
        meta.write_mha_metadata(view, lengths, lengths, table[:CONFIG.active - 2],
                                CONFIG.active + 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref.write_token_maps(ref_view, rows, positions, table, 48, inherited)
    ref.write_mha_metadata(ref_view, lengths, lengths, table[:CONFIG.active - 2],
                           CONFIG.active + 4)
    _assert_views_equal(view, ref_view)
