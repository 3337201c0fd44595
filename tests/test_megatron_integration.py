"""``mtpmeta.integrations.megatron``: the patched engine does what upstream's does.

Failure story: a patched helper that slices the wrong rows (the whole annotation array
instead of the active ones behind paused rows), passes another bound to the attention
kernel, or leaves another forward mode writes KV into another request's blocks or
launches attention with the wrong shape, and nothing in the engine notices. So random
steps (paused rows in front of active ones, prefix hits, graphed and eager loops, pad
tokens and pad slots) run through the stand-in engine (``tests/standin_megatron``)
unpatched, the reference, and patched, on both library paths, and every byte of the
context's view, every ``_mtp_activate_attn_metadata`` call and ``forward_mode`` after
every helper must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from mtpmeta import MTPForwardMode, MTPMetadata
from mtpmeta.errors import MTPDisabledError
from mtpmeta.integrations import megatron
from tests import standin_megatron
from tests.standin_megatron import mtp_metadata as standin_metadata

ROOT = Path(__file__).resolve().parents[1]
R, W, BS, D, MAX_TOKENS = 6, 6, 4, 63, 96
GRAPH_MAX_SEQLEN = W * BS + 8  # the engine's capture-time bound, not ForwardShape's
HELPERS = ("_mtp_begin_decode", "_mtp_setup_decode_step", "_mtp_setup_prefill_step")


@pytest.fixture
def upstream():
    """The stand-in modules under upstream's names; never left patched."""
    with standin_megatron.installed() as modules:
        try:
            yield modules
        finally:
            megatron.unpatch()


def make_context(modules: Dict[str, Any], mirror: bool = False) -> Any:
    context_module = modules[f"{standin_megatron.PACKAGE}.dynamic_context"]
    context = context_module.StandInContext(R, W, BS, D, MAX_TOKENS, GRAPH_MAX_SEQLEN)
    if mirror:  # the engine allocates on its device; on the CPU force the mirror path
        context.mtp_metadata.allocate("cpu", mirror=True)
    return context


def random_steps(seed: int, count: int = 10, full_batch: bool = False) -> List[Dict]:
    """Steps as data: rows (paused first), tables, prefix hits, a commit pass, a
    draft loop. Every written column holds an allocated block. A full batch
    (``P == R``) gets pad tokens only with ``full_batch`` (a documented difference),
    which makes every step one."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        total = R if full_batch else int(rng.integers(1, R + 1))
        paused = int(rng.integers(0, total + 1)) if rng.random() < 0.7 else 0
        paused = 0 if full_batch else paused
        n = total - paused
        depths = int(rng.integers(1, 4))
        table = np.full((R, W), -1, dtype=np.int32)
        hits = np.zeros(R, dtype=np.int32)
        counts = np.zeros(n, dtype=np.int64)
        starts = np.zeros(n, dtype=np.int64)
        for row in range(R):
            used = int(rng.integers(1, W + 1))
            table[row, :used] = rng.choice(D, size=used, replace=False)
        for i in range(n):
            row = paused + i
            used = int((table[row] >= 0).sum())
            hit = int(rng.integers(0, used)) if rng.random() < 0.4 else 0
            hits[row] = hit
            first = hit * BS - 1 if hit else int(rng.integers(0, used * BS))
            room = used * BS - depths - first  # positions left for commit + drafts
            if room < 0:
                first, room = max(used * BS - depths, 0), 0
            # A hit's pass writes its seam at least: drafts start past the prefix.
            low = 1 if hit else 0
            counts[i] = int(rng.integers(low, room + 1)) if rng.random() < 0.9 else low
            starts[i] = first
        pad = int(rng.integers(1, 4)) if full_batch else int(rng.integers(0, 4)) * (n < R)
        slots = None if rng.random() < 0.5 else int(rng.integers(n, R + 1))
        steps.append(dict(
            paused=paused, total=total, table=torch.from_numpy(table),
            hits=torch.from_numpy(hits), counts=torch.from_numpy(counts),
            starts=torch.from_numpy(starts), padded_tokens=int(counts.sum()) + pad,
            padded_requests=slots, padded=int(rng.integers(n, R + 1)),
            graphed=bool(rng.random() < 0.5), depths=depths,
            explicit_total=bool(rng.random() < 0.5)))
    return steps


def record(context: Any, what: str) -> Dict[str, Any]:
    calls = context.activations
    return dict(what=what, view=context.gpu_view._buf.clone(), calls=len(calls),
                call=dict(calls[-1]) if calls else None,
                mode=context.mtp_metadata.forward_mode.value,
                graphed_active=context.active_attn_metadata
                is context.graph_attn_metadata)


def static_buffers(n: int, active: torch.Tensor, fill: int) -> torch.Tensor:
    """``active`` ([n] or [n, W], active order) in a static ``R``-row buffer, the rest
    ``fill``: what a CUDA-graph engine keeps for its largest batch."""
    buffer = torch.full((R,) + tuple(active.shape[1:]), fill, dtype=active.dtype)
    buffer[:n] = active
    return buffer


def run(context: Any, steps: List[Dict], check: bool = False,
        static: bool = False, hits: Any = None) -> List[Dict[str, Any]]:
    """Drive ``steps`` through the context's helpers, as the engine calls them;
    ``static``: the caller's start positions (the commit's and the draft loop's) are
    ``R``-entry buffers in active order (``static_buffers``); ``hits``: the ``[R]``
    tensor the engine keeps each row's prefix hit in (the metadata's by default)."""
    trace = []
    meta = context.mtp_metadata
    for step in steps:
        context.paused_request_count, context.total_request_count = (step["paused"],
                                                                      step["total"])
        context.request_to_kv_block_ids.copy_(step["table"])
        (meta.request_matched_prefix_blocks if hits is None else hits).copy_(step["hits"])
        rows = slice(step["paused"], step["total"])
        counts, n = step["counts"], step["total"] - step["paused"]
        table, starts = context.request_to_kv_block_ids[rows], step["starts"]
        draft_starts = starts + counts
        if static:
            starts, draft_starts = (static_buffers(n, starts, 0),
                                    static_buffers(n, draft_starts, 0))
        context._mtp_setup_prefill_step(
            counts, table,
            padded_token_count=step["padded_tokens"],
            padded_request_count=step["padded_requests"],
            request_start_positions=starts,
            total=int(counts.sum()) if step["explicit_total"] else None)
        trace.append(record(context, "commit"))
        if check:
            meta.check_invariants(context.gpu_view)
        meta.end_forward()
        context._mtp_begin_decode(n, step["padded"], draft_starts,
                                  graphed=step["graphed"])
        trace.append(record(context, "begin"))
        for _ in range(step["depths"]):
            context._mtp_setup_decode_step()
            trace.append(record(context, "depth"))
            if check:
                meta.check_invariants(context.gpu_view)
            meta.advance_decode_step()
        meta.end_forward()
    return trace


def assert_same_trace(expected: List[Dict], actual: List[Dict]) -> None:
    assert len(expected) == len(actual)
    for index, (want, got) in enumerate(zip(expected, actual)):
        where = f"event {index} ({want['what']})"
        assert torch.equal(want["view"], got["view"]), f"{where}: view bytes differ"
        assert want["calls"] == got["calls"], where
        assert want["call"] == got["call"], f"{where}: {want['call']} != {got['call']}"
        if got["call"] is not None:
            assert all(type(value) in (bool, int) for value in got["call"].values()), where
        assert want["mode"] == got["mode"], where
        assert want["graphed_active"] == got["graphed_active"], where


@pytest.mark.parametrize("mirror", [False, True], ids=["direct", "mirror"])
@pytest.mark.parametrize("seed", range(4))
def test_patched_helpers_write_the_views_and_bounds_upstreams_write(upstream, seed, mirror):
    steps = random_steps(seed)
    reference = make_context(upstream)
    expected = run(reference, steps)
    assert isinstance(reference.mtp_metadata, standin_metadata.MTPMetadata)

    megatron.patch(block_counts=False)
    context = make_context(upstream, mirror=mirror)
    assert isinstance(context.mtp_metadata, MTPMetadata)
    actual = run(context, steps, check=True)
    assert_same_trace(expected, actual)
    assert any(s["paused"] for s in steps) and any(s["hits"].any() for s in steps)
    assert {s["graphed"] for s in steps} == {False, True}


@pytest.mark.parametrize("seed", range(3))
def test_static_caller_buffers_behind_paused_rows_are_read_in_active_order(upstream,
                                                                          seed):
    """A caller's ``R``-entry start-position buffers hold the active requests from
    entry 0, as upstream reads them; the patched helpers declare the split, which
    would read an ``R``-entry array from row ``paused``: they must not for these."""
    steps = [s for s in random_steps(20 + seed, count=12) if s["paused"]]
    assert steps
    expected = run(make_context(upstream), steps, static=True)
    megatron.patch(block_counts=False)
    actual = run(make_context(upstream, mirror=True), steps, static=True)
    assert_same_trace(expected, actual)


def test_prefill_step_leaves_upstreams_commit_mode_which_is_the_librarys(upstream):
    """The engine compares ``forward_mode`` with the MTPForwardMode it imported;
    after the patch, every such name is the library's enum."""
    megatron.patch()
    module = upstream[f"{standin_megatron.PACKAGE}.mtp_metadata"]
    mixin_module = upstream[f"{standin_megatron.PACKAGE}.mtp_context_mixin"]
    assert module.MTPForwardMode is MTPForwardMode
    assert mixin_module.MTPForwardMode is MTPForwardMode
    context = make_context(upstream)
    step = random_steps(7, count=1)[0]
    run(context, [dict(step, depths=1)])
    context._mtp_setup_prefill_step(step["counts"],
                                    step["table"][step["paused"]:step["total"]],
                                    request_start_positions=step["starts"])
    assert context.mtp_metadata.forward_mode is module.MTPForwardMode.COMMIT


def test_full_batch_pad_differs_only_in_the_documented_block_columns(upstream):
    """P == R with pad tokens: the absorbing request reads the dummy block past its
    span (README "Differences from upstream") until the first draft depth rewrites the
    table; every other byte and every call agrees."""
    steps = random_steps(11, count=3, full_batch=True)
    expected = run(make_context(upstream), steps)
    megatron.patch(block_counts=False)
    context = make_context(upstream)
    actual = run(context, steps)
    start, stop = context.gpu_view.spans["mha_block_table"]
    differing = 0
    for want, got in zip(expected, actual):
        if want["what"] == "depth":
            continue
        table_want = want["view"][start:stop].view(torch.int32).view(R, W)
        table_got = got["view"][start:stop].view(torch.int32).view(R, W)
        differs = (table_want != table_got).nonzero().tolist()
        assert all(row == R - 1 and table_got[row, col] == D for row, col in differs)
        differing += len(differs)
        want["view"][start:stop] = got["view"][start:stop]  # the rest must agree
    assert differing > 0
    assert_same_trace(expected, actual)


def test_eager_depth_after_device_start_positions_reads_the_bound_back(upstream,
                                                                       device_route):
    """Device start positions leave the host without the maximum (contract §10); the
    eager depth then reads it back from the view, and passes upstream's bound."""
    steps = [dict(s, graphed=False) for s in random_steps(3, count=3)]
    expected = run(make_context(upstream), steps)
    megatron.patch(block_counts=False)
    actual = run(make_context(upstream, mirror=True), steps)
    assert_same_trace(expected, actual)


def test_unpatch_restores_every_original_object_and_patch_twice_is_one(upstream):
    module = upstream[f"{standin_megatron.PACKAGE}.mtp_metadata"]
    mixin_module = upstream[f"{standin_megatron.PACKAGE}.mtp_context_mixin"]
    context_module = upstream[f"{standin_megatron.PACKAGE}.dynamic_context"]
    mixin = mixin_module.MTPContextMixin
    before = dict(metadata=module.MTPMetadata, mode=module.MTPForwardMode,
                  mixin_mode=mixin_module.MTPForwardMode,
                  context_metadata=context_module.MTPMetadata,
                  helpers={name: mixin.__dict__[name] for name in HELPERS})

    megatron.patch()
    patched = dict(vars(mixin))
    megatron.patch()
    assert megatron.is_patched() and dict(vars(mixin)) == patched
    assert module.MTPMetadata is MTPMetadata and context_module.MTPMetadata is MTPMetadata
    assert module.MTPForwardMode is MTPForwardMode
    assert all(mixin.__dict__[name] is not before["helpers"][name] for name in HELPERS)
    assert mixin.__dict__["_mtp_activate_attn_metadata"] is not None  # left alone

    megatron.unpatch()
    assert not megatron.is_patched()
    assert module.MTPMetadata is before["metadata"]
    assert module.MTPForwardMode is before["mode"]
    assert mixin_module.MTPForwardMode is before["mixin_mode"]
    assert context_module.MTPMetadata is before["context_metadata"]
    assert all(mixin.__dict__[name] is before["helpers"][name] for name in HELPERS)
    megatron.unpatch()  # not patched: nothing to do


def test_the_trace_bench_times_the_helpers_patch_installs(upstream):
    """The bench's ``megatron`` row (``mtpmeta.bench.engine_context``) binds the very
    functions ``patch()`` sets on upstream's mixin, so its figure is the patch's."""
    from mtpmeta.bench.engine_context import EngineContext

    megatron.patch()
    mixin = upstream[f"{standin_megatron.PACKAGE}.mtp_context_mixin"].MTPContextMixin
    assert set(megatron.HELPERS) == set(HELPERS)
    for name, helper in megatron.HELPERS.items():
        assert mixin.__dict__[name] is helper
        assert EngineContext.__dict__[name] is helper


def test_patch_without_megatron_raises_import_error_naming_the_module(monkeypatch):
    for name in [key for key in sys.modules if key.split(".")[0] == "megatron"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if not installed
    with pytest.raises(ImportError, match=megatron.METADATA_MODULE.replace(".", r"\.")):
        megatron.patch()
    assert not megatron.is_patched()


def test_patch_refuses_helpers_with_other_parameters_and_patches_nothing(upstream,
                                                                          monkeypatch):
    mixin = upstream[f"{standin_megatron.PACKAGE}.mtp_context_mixin"].MTPContextMixin
    monkeypatch.setattr(mixin, "_mtp_begin_decode",
                        lambda self, active_request_count, padded_count: None)
    with pytest.raises(ImportError, match="_mtp_begin_decode takes"):
        megatron.patch()
    assert not megatron.is_patched()
    module = upstream[f"{standin_megatron.PACKAGE}.mtp_metadata"]
    assert module.MTPMetadata is standin_metadata.MTPMetadata


def test_context_built_before_patch_is_refused_with_the_fix(upstream):
    context = make_context(upstream)
    megatron.patch()
    with pytest.raises(TypeError, match=r"patch\(\) before the engine builds"):
        context._mtp_begin_decode(1, 1, torch.zeros(1, dtype=torch.int32))


def test_disabled_cache_raises_an_assertion_error_as_upstreams_helpers(upstream):
    megatron.patch()
    context = make_context(upstream)
    context.enable_mtp_kv_cache = False
    with pytest.raises(MTPDisabledError):
        context._mtp_begin_decode(1, 1, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(AssertionError):
        context._mtp_setup_prefill_step(torch.ones(1, dtype=torch.int64),
                                        context.request_to_kv_block_ids[:1])


def test_importing_mtpmeta_imports_no_megatron():
    code = ("import mtpmeta, mtpmeta.integrations, mtpmeta.integrations.megatron, sys; "
            "assert not any(m.startswith('megatron') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith('megatron'))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
