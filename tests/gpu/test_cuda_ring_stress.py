"""The standard-step ring stress (``tests/ring_stress.py``) on a real GPU. Skipped
without CUDA; run by ``scripts/gpu_check.sh``; its simulator twin is
``tests/test_sim_ring_stress.py``.

The stream sleeps (``torch.cuda._sleep``) while the host runs a window of draft loops
and commit passes on 2 to 4 staging slots: every ring (begin, lengths, forward, and
the draft loop's shared stages) fills and then must wait on a fence whose copy is
still queued behind the sleep. After each call a device copy of the view and the
persistent buffers (the forward) is queued; after the window each must equal the
reference's. An event recorded right after the sleep tells whether the host had to
wait: not while it stages ``slots`` forwards, and exactly when a fence is pending.
The negative control removes the fence waits (``CopyFence.wait``) and must see wrong
forwards.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import ContextGPUView, MTPMetadata  # noqa: E402
from mtpmeta.bench.workload import make_steps  # noqa: E402
from mtpmeta.buffers.device_runtime import CopyFence, TorchRuntime, use_runtime  # noqa: E402

from tests.gpu.test_cuda_mirror import CONFIG  # noqa: E402
from tests.ring_stress import (BUFFERS, FIELDS, assert_ran_ahead_then_waited,  # noqa: E402
                               calls_per_step, first_stall, no_fence_waits,
                               reference_forwards, run_window,
                               wrong_forwards)

CUDA = torch.device("cuda")
R, W, TOKENS = CONFIG.max_requests, CONFIG.block_columns, CONFIG.max_tokens
STEPS = 4
SLEEP = 400_000_000  # GPU clock cycles: about 0.2 s, far above the window's host time


class _WatchedRuntime(TorchRuntime):
    """The real runtime, keeping every fence it hands out (to count the stalls)."""

    def __init__(self) -> None:
        self.fences: List[CopyFence] = []

    def fence(self, device: torch.device) -> CopyFence:
        fence = super().fence(device)
        self.fences.append(fence)
        return fence

    @property
    def stalls(self) -> int:
        return sum(fence.blocked for fence in self.fences)


def gpu_window(slots: int, seed: int):
    """One warm step, then ``STEPS`` steps behind a sleeping stream: (the forwards'
    fields and buffers, the calls, the fence stalls after each call, whether the
    stream had woken after each call)."""
    inputs = make_steps(CONFIG, STEPS + 1, seed)
    runtime = _WatchedRuntime()
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    with use_runtime(runtime):
        meta.allocate(CUDA, max_tokens=TOKENS, staging_slots=slots)
    view = ContextGPUView(R, TOKENS, W, CUDA)
    # Warm every kernel, cache and lazily loaded module: a first launch can synchronise
    # the context inside the window.
    run_window(meta, view, inputs[:1], CONFIG, lambda name: None)
    count = STEPS * calls_per_step(CONFIG)
    views = torch.zeros((count, view.buffer.numel()), dtype=torch.uint8, device=CUDA)
    buffers = {name: torch.zeros((count, *getattr(meta, name).shape),
                                 dtype=getattr(meta, name).dtype, device=CUDA)
               for name in BUFFERS}
    calls: List[str] = []
    stalls: List[int] = []
    woke: List[bool] = []
    torch.cuda.synchronize()
    base = runtime.stalls
    torch.cuda._sleep(SLEEP)
    awake = torch.cuda.Event()
    awake.record()

    def forward(name: str) -> None:  # no sync: device copies and an event query
        index = len(calls)
        views[index].copy_(view.buffer, non_blocking=True)
        for buffer in BUFFERS:
            buffers[buffer][index].copy_(getattr(meta, buffer), non_blocking=True)
        calls.append(name)
        stalls.append(runtime.stalls - base)
        woke.append(awake.query())

    run_window(meta, view, inputs[1:], CONFIG, forward)
    torch.cuda.synchronize()
    host_view = ContextGPUView(R, TOKENS, W, "cpu")
    views_host = views.cpu()
    buffers_host = {name: tensor.cpu() for name, tensor in buffers.items()}
    forwards = []
    for index in range(count):
        host_view.buffer.copy_(views_host[index])
        snap = {field: getattr(host_view, field).clone() for field in FIELDS}
        snap.update({name: buffers_host[name][index] for name in BUFFERS})
        forwards.append(snap)
    return forwards, calls, stalls, woke


def reference(seed: int):
    inputs = make_steps(CONFIG, STEPS + 1, seed)
    return reference_forwards(CONFIG, inputs[:1], inputs[1:])


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_standard_steps_behind_a_sleeping_stream_match_the_reference(slots):
    """Draft loops and commit passes on 2 to 4 slots, the stream asleep: every forward
    sees the reference's view and buffers; the host staged ``slots`` forwards without
    waiting, and its next use of a slot waited on the pending fence, until the
    stream woke."""
    seed = 30 + slots
    forwards, calls, stalls, woke = gpu_window(slots, seed)
    assert wrong_forwards(forwards, reference(seed)) == []
    assert_ran_ahead_then_waited(stalls, calls, woke, slots)


def test_no_fence_waits_let_the_standard_step_stress_see_wrong_forwards(monkeypatch):
    """Negative control: with the fence waits removed the host never waits, reuses
    slots whose copies are still queued, and forwards see a later step's data."""
    seed = 32
    with no_fence_waits(monkeypatch):
        forwards, calls, stalls, woke = gpu_window(2, seed)
    assert first_stall(stalls, calls)[0] == -1 and not any(woke)
    assert wrong_forwards(forwards, reference(seed)), "the stress cannot see a missing fence"
