"""The captured draft loop (contract §12) in a real ``torch.cuda.CUDAGraph``. Skipped
without CUDA.

Failure story: a setup op that reads the host, a pinned slot or a host scalar gets
baked into the graph, so a replay with fewer real requests than were captured writes
pad rows' KV into stale rows' real blocks, reads a stale row, or syncs. The graph holds
3 depths of setup + a toy forward (KV append through the token maps, attention through
the MHA fields) + advance; it is replayed after ``begin_decode(n', ...,
capture_setup=True)`` for n' in {P, P-1, 1, 0} and compared after every depth with the
default route run eagerly on CUDA. ``begin_decode`` + replay run under
``set_sync_debug_mode("error")`` and allocate nothing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import ContextGPUView, MTPMetadata  # noqa: E402
from mtpmeta.simulate.paged import PagedKVCache  # noqa: E402
from tests.captured_helpers import (CFG, CU_FIELDS, D, P, PADDED_FIELDS,  # noqa: E402
                                    R, REAL_FIELDS, VIEW_TOKENS, W, run_depths, schedule,
                                    toy_forward)

CUDA = torch.device("cuda")


def _objects():
    meta = MTPMetadata(**CFG.metadata_kwargs())
    meta.allocate(CUDA)
    view = ContextGPUView(R, VIEW_TOKENS, W, CUDA)
    cache = PagedKVCache(CFG, CUDA)
    x = torch.zeros(P, CFG.heads, CFG.head_dim, device=CUDA)
    return meta, view, cache, x


def _eager_default(steps):
    meta, view, cache, x = _objects()
    runs = []
    for n, starts, table, inputs in steps:
        x.copy_(inputs.to(CUDA))
        meta.begin_decode(n, P, starts, table, True)
        depths = [{k: v.cpu() for k, v in snap.items()}
                  for snap in run_depths(meta, view, cache, x)]
        meta.end_forward()
        runs.append(depths)
    return runs


def test_cuda_graph_of_the_captured_loop_replays_like_eager():
    steps = schedule(0)
    want = _eager_default(steps)
    meta, view, cache, x = _objects()
    meta.begin_decode_for_capture(P, capture_setup=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch recommends;
        meta.setup_decode_step(view)  # every row points at D: only the dummy block
        for _ in range(2):  # is written, and it is left out of the comparison
            toy_forward(cache, view, x, 0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        snaps = run_depths(meta, view, cache, x)
    meta.end_forward()
    got = []
    for n, starts, table, inputs in steps:
        x.copy_(inputs.to(CUDA))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            meta.begin_decode(n, P, starts, table, True, capture_setup=True)
            graph.replay()
            meta.end_forward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.cuda.memory_allocated() == allocated, "allocation at replay"
        torch.cuda.synchronize()
        got.append([{k: v.cpu() for k, v in snap.items()} for snap in snaps])
    for (n, *_), got_depths, want_depths in zip(steps, got, want):
        for depth, (a, b) in enumerate(zip(got_depths, want_depths)):
            where = f"n'={n} depth {depth}"
            for name in PADDED_FIELDS:
                assert torch.equal(a[name][:P], b[name][:P]), (where, name)
            for name in REAL_FIELDS:
                assert torch.equal(a[name][:n], b[name][:n]), (where, name)
            for name in CU_FIELDS:
                assert torch.equal(a[name][:P + 1], b[name][:P + 1]), (where, name)
            # Real blocks exactly; the dummy block takes racing pad-row writes.
            for name in ("k_cache", "v_cache"):
                assert torch.equal(a[name][:D].nan_to_num(7.0), b[name][:D].nan_to_num(7.0)), (
                    where, name)
            torch.testing.assert_close(a["attention"], b["attention"], rtol=1e-5, atol=1e-6)
            assert a["token_to_block_idx"][n:P].tolist() == [D] * (P - n), where


def test_captured_setup_run_eagerly_allocates_nothing():
    """Contract §12: the captured setup allocates nothing, eagerly too. A 1-D cumsum
    there would (CUDA's cub scan takes temporary storage from the caching allocator at
    every call, which the allocator's request count sees)."""
    meta, view, _, _ = _objects()
    n, starts, table, _ = schedule(0)[0]
    meta.begin_decode_for_capture(P, capture_setup=True)
    meta.end_forward()
    for _ in range(2):  # warm-up: views and plans built
        meta.begin_decode(n, P, starts, table, True, capture_setup=True)
        for _ in range(3):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
    torch.cuda.synchronize()
    requests = torch.cuda.memory_stats()["allocation.all.allocated"]
    meta.begin_decode(n, P, starts, table, True, capture_setup=True)
    for _ in range(3):
        meta.setup_decode_step(view)
        meta.advance_decode_step()
    meta.end_forward()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == requests
