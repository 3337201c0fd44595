"""The fixed stages' shared device landing zone (``mtpmeta/mirror/stages.py``),
under the CUDA-semantics simulator (``tests/cuda_sim.py``).

Every slot's H2D copy of a draft depth or commit pass lands in ONE device buffer (the
forward ring's ``zone``), so the next forward's copy must not overtake this one's
placement. On one stream CUDA orders them; across streams only an event wait does
(the persistent buffers' ``StreamOrder``, entered before each depth and pass). The
views the forwards of two streams write must be the reference's; with that wait
planted away, the simulator must see a view holding another forward's data (the
negative control: the race is real and these tests can see it)."""

from __future__ import annotations

import os
from typing import Any, List

import numpy as np
import pytest

from mtpmeta.buffers.device_runtime import StreamOrder
from tests.cuda_sim import CudaSim
from tests.test_cuda_sim import (FIELDS, host, make_sim, new_pair,  # noqa: F401
                                 random_call)

pytestmark = [
    pytest.mark.cuda_sim,
    pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                       reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call"),
]

R, W, BS = 8, 6, 4


def _forward(rng: np.random.Generator, depths: bool):
    """The calls of one forward (method, args after the view or None, kwargs): a commit
    pass, or with ``depths`` every other time a draft loop's begin and one depth."""
    if depths and rng.integers(0, 2):
        n = int(rng.integers(1, R + 1))
        starts = host(rng.integers(0, W * BS - 3, size=R).astype(np.int32))
        table = host(rng.integers(0, R * W, size=(R, W)).astype(np.int32))
        return [("begin_decode", (n, n, starts, table, False), None),
                ("setup_decode_step", (), {})]
    method, args, kwargs = random_call(rng, "commit")
    return [(method, args, kwargs)]


def wrong_views(sim: CudaSim, seed: int, *, depths: bool, calls: int = 32) -> List[int]:
    """Forwards issued on two streams in turn, each into a view of its own (written
    once, so it can be read after the device drains); the reference runs them in
    order. Returns the indices of the forwards whose view differs."""
    rng = np.random.default_rng(seed)
    lanes = [sim.Stream("a"), sim.Stream("b")]
    with sim:
        meta, ref, pairs = new_pair(sim, views=calls)
        for index, (view, ref_view) in enumerate(pairs):
            forward = _forward(rng, depths)
            with sim.stream(lanes[index % 2]):
                _apply(meta, view, forward)
            _apply(ref, ref_view, forward)
        sim.synchronize()
        got = [{name: sim.peek(getattr(view, name)) for name in FIELDS} for view, _ in pairs]
    return [index for index, ((_, ref_view), mine) in enumerate(zip(pairs, got))
            if any(not _equal(mine[name], getattr(ref_view, name)) for name in FIELDS)]


def _apply(meta: Any, view: Any, forward: List[Any]) -> None:
    """Run ``forward``'s calls on ``meta`` (a view call when it has kwargs), then end it."""
    for method, args, kwargs in forward:
        if kwargs is None:
            getattr(meta, method)(*args)
        else:
            getattr(meta, method)(view, *args, **kwargs)
    meta.end_forward()


def _equal(mine: Any, theirs: Any) -> bool:
    return bool((mine == theirs.to(mine.dtype).reshape(mine.shape)).all())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_forwards_on_two_streams_each_place_their_own_staged_data(make_sim, seed):
    """Depths and commit passes alternate between two streams, the device running the
    streams in a random interleaving: every view is the reference's."""
    assert wrong_views(make_sim(seed, idle=1.0), seed, depths=True) == []


class _NoWait(StreamOrder):
    """The planted bug: a stream order that tracks the stream but never waits."""

    def enter(self) -> None:
        self._stream = self._runtime.current_stream(self._device)


def test_two_streams_catch_a_zone_reused_without_the_stream_wait(make_sim, monkeypatch):
    """Negative control: commit passes only (no draft loop, so a view depends on
    nothing but what its own pass staged), without the wait: some stream's pass must
    place another pass's data (the next H2D copy into the zone overtook it)."""
    monkeypatch.setattr("mtpmeta.mirror.backend.StreamOrder", _NoWait)
    wrong = [index for seed in range(4)
             for index in wrong_views(make_sim(seed, idle=1.0), seed, depths=False)]
    assert wrong, "the two-stream test cannot see the zone reused across streams"
