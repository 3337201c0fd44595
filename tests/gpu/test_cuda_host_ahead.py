"""GPU tests that can fail for the bug they are named after. Skipped
without CUDA; run by ``scripts/gpu_check.sh``.

One detector covers every hidden sync and fence stall: the stream is put to sleep
(``torch.cuda._sleep``) and an event recorded behind the sleep; the host then runs the
whole draft loop and commit pass. If anything in them waited for the device (a
``.item()``, a blocking upload, an event synchronize in a fence wait, a copy that
cannot start before the stream gets to it) the host would only get past it once the
sleep is over, so the event would read done. Each test warms every kernel and cache
first: the first launch of a lazily loaded module can synchronise the context, which
would make the result depend on test order.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import ContextGPUView, MTPMetadata  # noqa: E402
from mtpmeta.bench.measure import cuda_syncs  # noqa: E402
from mtpmeta.bench.workload import make_steps, run_commit, run_step  # noqa: E402
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata  # noqa: E402
from mtpmeta.buffers.device_runtime import TorchRuntime, use_runtime  # noqa: E402

from tests.gpu.test_cuda_mirror import (CONFIG, _expected_buffers,  # noqa: E402
                                        _token_inputs)

CUDA = torch.device("cuda")
R, W, BS = CONFIG.max_requests, CONFIG.block_columns, CONFIG.block_size
TOKENS = CONFIG.max_tokens
SLEEP = 400_000_000  # GPU clock cycles: about 0.2 s on an H200, far above a step's host time


def _gpu():
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    with use_runtime(TorchRuntime()):
        meta.allocate(CUDA)
    return meta, ContextGPUView(R, TOKENS, W, CUDA)


def _asleep() -> torch.cuda.Event:
    """Put the current stream to sleep; the event completes when it wakes."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    event = torch.cuda.Event()
    event.record()
    return event


def _draft_and_commit(meta, view, inputs, graphed: bool, extra=None) -> None:
    meta.begin_decode(CONFIG.active, CONFIG.active + 3, inputs.start_positions,
                      inputs.block_table, graphed)
    for _ in range(CONFIG.depths):
        meta.setup_decode_step(view)
        meta.stage_decode_lengths()
        meta.advance_decode_step()
    meta.end_forward()
    if extra is not None:
        extra()
    run_commit(meta, view, inputs)


def _host_ran_ahead(graphed: bool, extra=None) -> bool:
    meta, view = _gpu()
    steps = make_steps(CONFIG, 3, seed=31)
    for inputs in steps[:2]:  # warm every kernel, cache and lazily loaded module
        run_step(meta, view, inputs, CONFIG)
        _draft_and_commit(meta, view, inputs, graphed)
    if extra is not None:
        extra()
    torch.cuda.synchronize()
    awake = _asleep()
    _draft_and_commit(meta, view, steps[2], graphed, extra)
    ahead = not awake.query()
    torch.cuda.synchronize()
    return ahead


@pytest.mark.parametrize("graphed", [False, True])
def test_draft_loop_and_commit_pass_never_wait_for_the_device(graphed):
    """No hidden sync and no fence stall: the host finishes the draft loop and the
    commit pass while the stream is still asleep."""
    assert _host_ran_ahead(graphed), "the host waited for the device"


def test_the_detector_trips_on_one_pageable_copy():
    """Negative control: the same run plus one non_blocking copy into pageable host
    memory (CUDA returns from it only once the copy is done, i.e. after the sleep) must
    trip the detector."""
    source = torch.arange(1 << 16, dtype=torch.int32, device=CUDA)
    pageable = torch.empty(1 << 16, dtype=torch.int32)  # not pinned

    def one_pageable_copy():
        pageable.copy_(source, non_blocking=True)

    assert not _host_ran_ahead(False, one_pageable_copy), (
        "a pageable copy did not trip the detector: it cannot see hidden syncs")


def test_carry_of_a_pageable_hidden_lets_the_host_run_ahead_and_keeps_the_value():
    """The carry stages a pageable hidden through pinned memory: the host must not wait
    for the sleeping stream (a pageable non_blocking copy may), and the caller's
    overwrite right after the call must not reach the carried value."""
    meta, _ = _gpu()
    H = CONFIG.hidden_size
    hidden = torch.arange(H, dtype=torch.float32)  # pageable host memory
    meta.carry_chunk_boundary(hidden, 1, 2)  # warm the ring
    torch.cuda.synchronize()
    awake = _asleep()
    meta.carry_chunk_boundary(hidden, 3, 7)
    ahead = not awake.query()
    hidden.fill_(-1.0)  # the caller reuses its tensor at once
    torch.cuda.synchronize()
    assert ahead, "carry_chunk_boundary waited for the device"
    assert meta.take_chunk_boundary(3, 7).view(-1).cpu().tolist() == list(range(H))


def test_carry_of_a_device_hidden_freed_by_another_stream_keeps_the_value():
    """A producer stream makes the hidden and frees it right after the call, then
    allocates and overwrites memory on its own stream: without record_stream the
    caching allocator could hand it the hidden's block before the carry's copy ran."""
    meta, _ = _gpu()
    H = CONFIG.hidden_size
    producer = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP // 2)  # the carry's copy stays queued on this stream
    with torch.cuda.stream(producer):
        hidden = torch.full((1, 1, H), 2.5, device=CUDA)
    torch.cuda.current_stream().wait_stream(producer)
    meta.carry_chunk_boundary(hidden, 4, 9)
    del hidden
    with torch.cuda.stream(producer):
        clobber = [torch.full((1, 1, H), -7.0, device=CUDA) for _ in range(8)]
    torch.cuda.synchronize()
    assert meta.take_chunk_boundary(4, 9).eq(2.5).all()
    del clobber


def _two_overlapping_streams(share_stage: bool, rounds: int = 96):
    """Forwards on two streams whose work overlaps for real: both streams first sleep,
    so the host queues many forwards on each (32 staging slots), and then drain at once,
    their copies and scatters interleaving on the device (small random sleeps add
    jitter). ``share_stage`` plants the bug the per-slot device stages prevent: every
    slot's H2D copy lands in one shared device stage. Returns the wrong rounds."""
    table, rows, pos = _token_inputs(rounds, seed=23)
    expected = _expected_buffers(table, rows, pos, 40)
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    with use_runtime(TorchRuntime()):
        meta.allocate(CUDA, staging_slots=32)
    ring = meta._backend.forward.ring
    if share_stage:  # installed through the ring's device_slots, not the library code
        ring.device_slots = ring.device_slots[:1].expand_as(ring.device_slots)
    views = [ContextGPUView(R, TOKENS, W, CUDA) for _ in range(rounds)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    rng = random.Random(5)
    meta.write_token_maps(views[0], rows[0], pos[0], table, 40)  # warm up
    torch.cuda.synchronize()
    for stream in streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP // 4)
    for i in range(rounds):
        with torch.cuda.stream(streams[i % 2]):
            torch.cuda._sleep(rng.randrange(0, SLEEP // 5000))
            meta.write_token_maps(views[i], rows[i], pos[i], table, 40)
    torch.cuda.synchronize()
    return [i for i in range(rounds) if not torch.equal(views[i].buffer.cpu(), expected[i])]


def test_two_overlapping_streams_each_get_their_own_staged_data():
    assert _two_overlapping_streams(False) == []


def test_two_streams_catch_a_planted_shared_device_stage():
    """Negative control: with one device stage shared by every slot, the overlapping
    streams must see some forward holding the other stream's data."""
    assert _two_overlapping_streams(True), "the two-stream test cannot see a shared stage"


def test_bench_sync_column_counts_every_cuda_sync():
    """The bench counts syncs CUDA reports, not only ``.item()``: the reference's
    blocking uploads and ``repeat_interleave`` count too, so its eager step shows more
    syncs than its scalar reads; the mirror path shows none."""
    steps = make_steps(CONFIG, 2, seed=41)
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate(CUDA)
    ref_view = ReferenceGPUView(R, TOKENS, W, CUDA)
    run_step(ref, ref_view, steps[0], CONFIG)
    torch.cuda.synchronize()
    syncs = cuda_syncs(lambda: run_step(ref, ref_view, steps[1], CONFIG))
    assert syncs > CONFIG.depths + 2, syncs  # more than its per-depth and commit reads
    meta, view = _gpu()
    run_step(meta, view, steps[0], CONFIG)
    torch.cuda.synchronize()
    assert cuda_syncs(lambda: run_step(meta, view, steps[1], CONFIG)) == 0
