"""The view cache keeps the views in use and drops the least recently used one.

Failure story: an engine writes one hot view at every step and, now and then, a view it
uses once (a warmup per CUDA-graph bucket, a debug view). A cache that evicts in
insertion order throws the hot view's target away once it has seen as many other views
as it holds, and rebuilds it (its stages, and a device synchronize when the target held
scratch) in the steady state.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.gpu_view import ViewCache
from tests.helpers import config

CAPACITY = 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_view_cache_keeps_exactly_the_most_recently_used_views(uses):
    """Any sequence of uses of six views against a three-entry cache: a use keeps its
    target exactly when a least-recently-used model still holds the view."""
    views = [ContextGPUView(2, 4, 3) for _ in range(6)]
    cache = ViewCache(CAPACITY)
    targets: dict = {}
    recent: list = []  # the model: most recent last
    for index in uses:
        target = cache.resolve(views[index])
        if index in recent:
            assert target is targets[index], f"view {index} was evicted while recent"
            recent.remove(index)
        else:
            assert target is not targets.get(index)
            if len(recent) == CAPACITY:
                recent.pop(0)
        recent.append(index)
        targets[index] = target


def test_hot_draft_view_keeps_its_target_among_many_one_off_views():
    """A view used by every draft depth keeps its target while a new one-off view is
    written between depths, nine times (more than the cache holds)."""
    kwargs = config()
    R, W = kwargs["max_requests"], kwargs["max_kv_block_count"]
    meta = MTPMetadata(**kwargs)
    meta.allocate("cpu", mirror=True)
    hot = ContextGPUView(R, 64, W)
    starts = torch.from_numpy(np.arange(R, dtype=np.int32))
    table = torch.from_numpy((np.arange(R * W) % 40).astype(np.int32).reshape(R, W))
    meta.begin_decode(5, 6, starts, table, False)
    meta.setup_decode_step(hot)
    first = meta._target(hot)
    for _ in range(9):
        one_off = ContextGPUView(R, 64, W)
        meta.write_mha_metadata(one_off, torch.ones(2, dtype=torch.int32),
                                torch.full((2,), 3, dtype=torch.int32), table[:2], 2)
        meta.setup_decode_step(hot)
        assert meta._target(hot) is first
    meta.end_forward()
