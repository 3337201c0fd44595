"""The standard-step ring stress (``tests/ring_stress.py``) under the CUDA-semantics
simulator (``tests/cuda_sim.py``): the GPU test's scenario on the CPU, so it runs in CI.

The simulated device runs behind the host (seeded lag) or, for the host-ahead check,
runs nothing on its own: then only a fence wait (an event synchronize, counted as a
stall) moves it, and an event recorded before the window tells whether the host had
to wait for it. Both negative controls remove the fence wait and must fail.
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import pytest
import torch

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.workload import make_steps
from tests.cuda_sim import CudaSim
from tests.ring_stress import (BUFFERS, FIELDS, assert_ran_ahead_then_waited,
                               calls_per_step, first_stall, no_fence_waits,
                               reference_forwards, run_window,
                               wrong_forwards)
from tests.test_cuda_sim import assert_no_hidden_copies, small_step_config

pytestmark = [
    pytest.mark.cuda_sim,
    pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                       reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call"),
]

CFG = small_step_config()
STEPS = 4
LAG = dict(idle=0.92, burst=0.3, burst_max=24)  # far behind, in bursts
STALLED = dict(idle=1.0)  # runs nothing until the host waits


def sim_window(slots: int, seed: int, **lag: Any) -> Tuple[list, List[str], List[int],
                                                           List[bool], CudaSim]:
    """One warm step, then ``STEPS`` steps behind the device under a simulator with
    ``lag``: (the forwards' fields and buffers, the calls, the stalls after each call,
    whether the device had passed the window's start after each call, the simulator)."""
    inputs = make_steps(CFG, STEPS + 1, seed)
    sim = CudaSim(seed, **lag)
    forwards, calls, stalls, awake = [], [], [], []
    with sim:
        meta = MTPMetadata(**CFG.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=CFG.max_tokens, staging_slots=slots)
        view = ContextGPUView(CFG.max_requests, CFG.max_tokens, CFG.block_columns)
        run_window(meta, view, inputs[:1], CFG, lambda name: None)
        sim.synchronize()
        start = torch.zeros(1)  # a device op ahead of the window, then its event
        start.add_(1)
        started = sim.Event()
        started.record()
        base = sim.stalls

        def forward(name: str) -> None:
            snap = {field: getattr(view, field).clone() for field in FIELDS}
            snap.update({buffer: getattr(meta, buffer).clone() for buffer in BUFFERS})
            forwards.append(snap)
            calls.append(name)
            stalls.append(sim.stalls - base)
            awake.append(started._done())  # a look, not a query: it moves nothing

        run_window(meta, view, inputs[1:], CFG, forward)
        sim.synchronize()
        assert_no_hidden_copies(sim)
    assert len(calls) == STEPS * calls_per_step(CFG)
    return forwards, calls, stalls, awake, sim


def reference(seed: int):
    inputs = make_steps(CFG, STEPS + 1, seed)
    return reference_forwards(CFG, inputs[:1], inputs[1:])


@pytest.mark.parametrize("slots", [2, 3, 4])
@pytest.mark.parametrize("lag", ["lagging", "stalled"])
def test_standard_steps_through_every_ring_match_the_reference(slots, lag):
    """Draft loops and commit passes on 2 to 4 staging slots, the device far behind:
    every forward sees the reference's view and buffers, and the fences really held
    the host back (slots were reused while their copies were queued)."""
    seed = 10 + slots
    forwards, _, stalls, _, _ = sim_window(slots, seed,
                                           **(LAG if lag == "lagging" else STALLED))
    assert wrong_forwards(forwards, reference(seed)) == []
    assert stalls[-1] > 0, "no fence was ever pending: the stress proves nothing"


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_host_stages_slots_forwards_ahead_then_waits_on_the_pending_fence(slots):
    """With a device that runs nothing on its own, the host stages ``slots`` forwards
    (draft depths and commits) with no wait, and the device never passes the window's
    start meanwhile; the next ring use waits on a pending fence, and only then has
    the device run past the start."""
    _, calls, stalls, awake, _ = sim_window(slots, 20 + slots, **STALLED)
    assert_ran_ahead_then_waited(stalls, calls, awake, slots)


def test_no_fence_waits_let_the_standard_step_stress_see_wrong_forwards(monkeypatch):
    """Negative control: the same stress with the fence waits removed (``CopyFence``'s
    ``wait`` a no-op) sees forwards holding a later step's staged data, and the host
    never waits."""
    seed = 12
    with no_fence_waits(monkeypatch):
        forwards, calls, stalls, awake, _ = sim_window(2, seed, **LAG)
    assert wrong_forwards(forwards, reference(seed)), "the stress cannot see a missing fence"
    with no_fence_waits(monkeypatch):
        _, calls, stalls, awake, _ = sim_window(2, 22, **STALLED)
    assert first_stall(stalls, calls)[0] == -1 and not any(awake)
