"""GPU integration tests of the mirror path. Skipped without CUDA.

Failure stories: a sync hidden in the draft loop or the commit pass (caught by sync
debug mode), a captured forward replayed with fewer real requests than were captured
reading stale rows, a pinned staging slot rewritten while its async copy is still queued
behind slow GPU work (with a negative control that must fail), and a device start
position past the table killing the CUDA context. Expected values are computed first
(the direct path or the reference on the CPU), so the raced regions hold no sync. The
host-ahead detector, the carry, two overlapping streams and the bench's sync count are
in ``test_cuda_host_ahead.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import VIEW_FIELDS, ContextGPUView, GraphCaptureError, MTPMetadata  # noqa: E402
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata  # noqa: E402
from mtpmeta.buffers.device_runtime import TorchRuntime, use_runtime  # noqa: E402
from mtpmeta.bench.workload import StepConfig, make_steps, run_commit, run_step  # noqa: E402

CONFIG = StepConfig(max_requests=64, block_columns=32, block_size=16, active=48,
                    prefill_tokens=64, inherited_blocks=2, moves=8, swaps=2, resets=8)
CUDA = torch.device("cuda")
R, W, BS = CONFIG.max_requests, CONFIG.block_columns, CONFIG.block_size
D = CONFIG.dummy_block
TOKENS = CONFIG.max_tokens
SLEEP = 200_000_000  # GPU clock cycles: about 0.1 s on an H200


class _NoFenceRuntime(TorchRuntime):
    """Negative control: staging slots are reused without waiting for their copies."""

    def fence(self, device):
        class NoFence:
            def record(self):
                pass

            def wait(self):
                pass

        return NoFence()


def _gpu(runtime=None):
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    with use_runtime(runtime or TorchRuntime()):
        meta.allocate(CUDA)
    return meta, ContextGPUView(R, TOKENS, W, CUDA)


def _pair():
    meta, view = _gpu()
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    return meta, view, ref, ReferenceGPUView(R, TOKENS, W, CUDA)


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
        for name in ("offsets", "block_table", "query_lengths", "kv_lengths",
                     "chunk_boundary_hidden"):
            assert torch.equal(getattr(meta, name).cpu(), getattr(ref, name).cpu()), name
        assert torch.equal(meta.request_matched_prefix_blocks,
                           ref.request_matched_prefix_blocks)


def test_staging_memory_is_pinned():
    meta, _ = _gpu()
    backend = meta._backend
    for ring in (backend.begin.ring, backend.prefill_lengths.ring, backend.forward.ring,
                 backend.carry.ring):
        assert ring.host.is_pinned()
    assert meta.request_matched_prefix_blocks.is_pinned()


@pytest.mark.parametrize("graphed", [False, True])
def test_draft_loop_and_commit_pass_make_no_sync(graphed):
    meta, view = _gpu()
    steps = make_steps(CONFIG, 3, seed=12)
    run_step(meta, view, steps[0], CONFIG)  # warm caches and JIT
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inputs in steps[1:]:
            meta.begin_decode(CONFIG.active, CONFIG.active + 3, inputs.start_positions,
                              inputs.block_table, graphed)
            for _ in range(CONFIG.depths):
                meta.setup_decode_step(view)
                meta.stage_decode_lengths()
                meta.advance_decode_step()
            meta.end_forward()
            run_commit(meta, view, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _DraftForward:
    """A stand-in MTP forward that reads the view the way attention and the KV write
    do: per token, the block and slot it writes and its request's KV length."""

    def __init__(self, padded: int) -> None:
        self.padded = padded
        self.kv = torch.arange((D + 1) * BS, dtype=torch.float32, device=CUDA).view(D + 1, BS)
        self.out = torch.zeros(padded, dtype=torch.float32, device=CUDA)
        self.lengths = torch.zeros(padded, dtype=torch.int32, device=CUDA)

    def __call__(self, view) -> None:
        blocks = view.token_to_block_idx[:self.padded].long()
        slots = view.token_to_local_position_within_kv_block[:self.padded].long()
        self.out.copy_(self.kv[blocks, slots])
        self.lengths.copy_(view.mha_kv_seq_lengths[:self.padded])


def _capture(forward, view):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(view)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(view)
    return graph


@pytest.mark.parametrize("real", [16, 9, 1])
def test_replayed_forward_sees_eager_setup_with_fewer_real_requests(real):
    """Capture the forward at padded 16; before each replay, setup runs eagerly
    (graphed=True). Replays with 16, 9 or 1 real requests must equal the eager
    forward over the reference's view, pad rows reading the dummy block."""
    meta, view, ref, ref_view = _pair()
    P = 16
    meta.begin_decode_for_capture(P)
    meta.setup_decode_step(view)
    forward, expected_forward = _DraftForward(P), _DraftForward(P)
    graph = _capture(forward, view)
    meta.end_forward()
    table = torch.randperm(R * W, dtype=torch.int32).view(R, W)
    for step in range(3):
        starts = torch.randint(0, W * BS - 4, (R,), dtype=torch.int32)
        meta.begin_decode(real, P, starts, table, True)
        ref.begin_decode(real, P, starts.to(CUDA), table.to(CUDA), True)
        for _ in range(3):
            shape = meta.setup_decode_step(view)
            assert shape.padded_request_count == P
            graph.replay()
            ref.setup_decode_step(ref_view)
            expected_forward(ref_view)
            torch.cuda.synchronize()
            assert torch.equal(forward.out, expected_forward.out)
            assert torch.equal(forward.lengths, expected_forward.lengths)
            assert view.token_to_block_idx[real:P].eq(D).all()
            meta.advance_decode_step()
            ref.advance_decode_step()
        assert torch.equal(torch.from_numpy(meta._backend.host_offsets[:real]),
                           meta.offsets[:real].cpu())
        meta.end_forward()
        ref.end_forward()


def test_staging_calls_inside_a_capture_are_refused():
    meta, view = _gpu()
    meta.begin_decode_for_capture(8)
    meta.setup_decode_step(view)
    scratch = torch.zeros(4, device=CUDA)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for call in (lambda: meta.setup_decode_step(view), meta.advance_decode_step,
                     lambda: meta.begin_decode_for_capture(8)):
            with pytest.raises(GraphCaptureError):
                call()
        scratch.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert scratch.tolist() == [1.0] * 4
    meta.setup_decode_step(view)  # eager again: works


def _token_inputs(rounds, seed, T=32):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, D, (R, W), generator=g, dtype=torch.int32)
    rows = [torch.randint(0, R, (T,), generator=g) for _ in range(rounds)]
    pos = [torch.randint(0, W * BS, (T,), generator=g) for _ in range(rounds)]
    return table, rows, pos


def _expected_buffers(table, rows, pos, padded):
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    meta.allocate("cpu")
    view = ContextGPUView(R, TOKENS, W, "cpu")
    out = []
    for r, p in zip(rows, pos):
        meta.write_token_maps(view, r, p, table, padded)
        out.append(view.buffer.clone())
    return out


def _run_stress(runtime, rounds=24, T=32):
    """Host races ahead of a sleeping stream; returns (mismatching rounds, ran_ahead)."""
    table, rows, pos = _token_inputs(rounds, seed=14, T=T)
    expected = _expected_buffers(table, rows, pos, T + 8)
    meta, view = _gpu(runtime)
    snaps = torch.zeros((rounds, view.buffer.numel()), dtype=torch.uint8, device=CUDA)
    slots = meta._backend.forward.ring.num_slots
    # Warm every kernel first: a lazily loaded module's first launch can synchronise
    # the context inside the window, which would make the result depend on test order.
    meta.write_token_maps(view, rows[0], pos[0], table, T + 8)
    snaps[0].copy_(view.buffer, non_blocking=True)
    torch.cuda.synchronize()
    asleep = torch.cuda.Event()
    torch.cuda._sleep(SLEEP)
    asleep.record()
    ran_ahead = None
    for i in range(rounds):  # no sync anywhere in this loop
        meta.write_token_maps(view, rows[i], pos[i], table, T + 8)
        snaps[i].copy_(view.buffer, non_blocking=True)
        if i == slots - 1:
            ran_ahead = not asleep.query()  # every slot staged before the GPU woke
    torch.cuda.synchronize()
    bad = [i for i in range(rounds) if not torch.equal(snaps[i].cpu(), expected[i])]
    return bad, ran_ahead


def test_pinned_ring_survives_a_slow_stream():
    bad, ran_ahead = _run_stress(TorchRuntime())
    assert ran_ahead, "the host never got ahead of the GPU: the test proves nothing"
    assert bad == []


def test_stress_detects_missing_fences():
    """Negative control: with no-op fences the same stress MUST see corrupted rounds."""
    bad, ran_ahead = _run_stress(_NoFenceRuntime())
    assert ran_ahead and bad, "the stress test cannot see a missing fence"


def test_device_start_past_the_table_does_not_kill_the_context():
    """Unchecked device start positions must be clamped and sent to the dummy block,
    never gathered out of bounds (a device-side assert). Run in a subprocess so a dead
    CUDA context cannot take pytest with it."""
    script = textwrap.dedent(f"""
        import torch
        from mtpmeta import MTPMetadata, ContextGPUView
        from mtpmeta.bench.workload import StepConfig
        config = StepConfig(max_requests={R}, block_columns={W}, block_size={BS},
                            active=48, prefill_tokens=64, inherited_blocks=2)
        meta = MTPMetadata(**config.metadata_kwargs()); meta.allocate('cuda')
        view = ContextGPUView({R}, {TOKENS}, {W}, 'cuda')
        starts = torch.tensor([{W * BS}, -1, 5, 0] + [0] * {R - 4}, dtype=torch.int32,
                              device='cuda')
        table = torch.zeros(({R}, {W}), dtype=torch.int32, device='cuda')
        meta.begin_decode(4, 4, starts, table, False)
        meta.setup_decode_step(view)
        torch.cuda.synchronize()
        print(view.token_to_block_idx[:4].tolist())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-800:]
    assert f"[{D}, {D}, 0, 0]" in result.stdout


def test_commit_pass_device_block_table_is_the_documented_sync():
    """A device block table is read back (documented in setup_commit_pass); host
    inputs make the same pass without any sync."""
    meta, view = _gpu()
    host_table = torch.arange(R * W, dtype=torch.int32).view(R, W) % D
    counts = torch.tensor([3, 2, 4], dtype=torch.int32)
    device_table = host_table.to(CUDA)
    meta.setup_commit_pass(view, counts, host_table)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.setup_commit_pass(view, counts, host_table)
        with pytest.raises(RuntimeError):
            meta.setup_commit_pass(view, counts, device_table)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_commit_pass_with_the_device_copy_of_its_rows_makes_no_sync():
    """``device_block_table``: the host rows place the blocks, the device copy gives the
    view's table rows with no sync, the copy may be freed at once, and the view is the
    reference's."""
    meta, view, ref, ref_view = _pair()
    host_table = (torch.arange(R * W, dtype=torch.int32).view(R, W) % D)[:3].pin_memory()
    counts = torch.tensor([3, 2, 4], dtype=torch.int32)
    starts = torch.tensor([0, 5, 17], dtype=torch.int32)
    meta.setup_commit_pass(view, counts, host_table, start_positions=starts,
                           device_block_table=host_table.to(CUDA))  # warm
    device_table = host_table.to(CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.setup_commit_pass(view, counts, host_table, start_positions=starts,
                               padded_request_count=4, device_block_table=device_table)
        del device_table
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref.setup_commit_pass(ref_view, counts, host_table, start_positions=starts,
                          padded_request_count=4)
    _assert_views_equal(view, ref_view)


def test_commit_pass_takes_the_draft_loop_rows_device_to_device():
    """On CUDA: a commit pass after a draft loop on the same table takes rows ``[:n]``
    from the device (``n * W`` ids fewer host-to-device bytes than the same commit on
    a table that differs in one entry), and both views are the reference's, though a
    write behind the version counter (``.data``) changed ``block_table`` meanwhile:
    the rows come from the private copy begin_decode filled."""
    from mtpmeta.bench.counters import H2DCounter, StagingRecorder

    recorder = StagingRecorder()
    meta, view = _gpu(recorder)
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    ref_view = ReferenceGPUView(R, TOKENS, W, CUDA)
    inputs = make_steps(CONFIG, 1, seed=13)[0]
    changed = inputs.block_table.clone()
    changed[0, 0] += 1
    nbytes = []
    for table in (inputs.block_table, changed):
        step = dataclasses.replace(inputs, block_table=table)
        for obj, obj_view in ((meta, view), (ref, ref_view)):
            obj.begin_decode(CONFIG.active, CONFIG.active, inputs.start_positions,
                             inputs.block_table, False)
            obj.setup_decode_step(obj_view)
            obj.end_forward()
        meta.block_table.data[0, 0] += 1  # reaches neither commit
        with H2DCounter(recorder) as counter:
            run_commit(meta, view, step)
        run_commit(ref, ref_view, step)
        _assert_views_equal(view, ref_view)
        nbytes.append(counter.nbytes)
    assert nbytes[1] - nbytes[0] == CONFIG.active * W * 4
    assert meta._backend.reused_table_rows == CONFIG.active
