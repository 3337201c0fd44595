"""Calls in and out of ``torch.inference_mode``, in any order, on one object.

Megatron's controller runs the MTP helpers inside ``torch.inference_mode()``, and a
scheduler may call outside it too (a warm-up, a reset, a test). Upstream's buffers are
all made at construction, so its class takes both when built outside the mode. The
library makes some buffers, scratch and cached dtype views lazily, at the first call
that needs them; made inside inference mode they would be inference tensors, and the
first call outside it would fail writing them ("Inplace update to inference tensor
outside InferenceMode"). The tests build their objects outside inference mode, as an
engine builds its context (one allocates inside it: ``allocate`` makes normal tensors
in either mode), then switch mode between calls and compare every byte with the
reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtpmeta import MTPMetadata
from mtpmeta.bench.trace import STANDARD_TRACE, TraceConfig, make_trace
from mtpmeta.bench.trace_replay import Replay, check_trace
from mtpmeta.buffers.grad_mode import kept_dtype_view, kept_tensors
from tests.helpers import assert_buffers_equal, assert_views_equal, config, \
    make_reference, make_views

STEPS = 12
#: The standard traffic on a table four times wider than its blocks in use: counted
#: passes ship packed rows and complete them with whole rows of the dummy block, which
#: the first such pass makes.
WIDE = TraceConfig(**{**STANDARD_TRACE.__dict__, "block_columns": 512, "pool_columns": 128})
SCHEDULES = {  # trace steps run inside inference mode
    "inside first": {0, 1, 2, 3, 8, 9, 10, 11},
    "outside first": {4, 5, 6, 7},
    "alternating": set(range(0, STEPS, 2)),
}


def test_a_dtype_view_made_inside_inference_mode_is_kept_normal():
    """The torch behaviour the helpers exist for: inside inference mode a slice of a
    normal tensor stays normal, but its dtype view and a new tensor do not."""
    words = torch.zeros(4, dtype=torch.int64)
    with torch.inference_mode():
        plain, kept = words.view(torch.int32), kept_dtype_view(words, torch.int32)
        sliced = words[:2]
        with kept_tensors():
            made = torch.zeros(2)
    assert plain.is_inference() and not kept.is_inference() and not sliced.is_inference()
    assert not made.is_inference()
    kept.add_(1)  # outside inference mode: allowed on a normal tensor
    made.add_(1)
    assert words.tolist() == [2**32 + 1] * 4 and made.tolist() == [1.0, 1.0]


@pytest.fixture(scope="module")
def standard_steps():
    return make_trace(STANDARD_TRACE, STEPS, seed=3)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_path_takes_trace_steps_in_and_out_of_inference_mode(standard_steps,
                                                                   schedule):
    """The trace replayed through every path (the direct, mirror and captured paths,
    drop-in, the patched Megatron helpers on host and on the engine's device placement,
    block counts, device start positions), steps switching mode: each step's view and
    buffers equal the reference's."""
    assert check_trace(STANDARD_TRACE, standard_steps,
                       inference_steps=SCHEDULES[schedule]) is None


@settings(max_examples=8, deadline=None)
@given(inside=st.sets(st.integers(0, STEPS - 1)))
def test_any_schedule_of_modes_leaves_the_references_bytes(standard_steps, inside):
    """Any set of trace steps inside inference mode, the rest outside it: every path's
    view and buffers equal the reference's at every step."""
    assert check_trace(STANDARD_TRACE, standard_steps, inference_steps=inside) is None


def _inference_tensors(root):
    """``(path, shape)`` of each inference tensor reachable from ``root`` through the
    library's objects (attributes, slots, dicts, lists, tuples); the bench's own
    objects (its runtime's recorded read-backs) are left out."""
    seen, stack, found = set(), [("meta", root)], []
    while stack:
        name, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.is_inference():
                found.append((name, tuple(value.shape)))
            continue
        module = type(value).__module__
        if isinstance(value, dict):
            stack.extend((f"{name}[{key!r}]", item) for key, item in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{name}[{index}]", item) for index, item in enumerate(value))
        elif module.startswith("mtpmeta") and not module.startswith("mtpmeta.bench"):
            fields = dict(vars(value)) if hasattr(value, "__dict__") else {}
            fields.update((slot, getattr(value, slot, None))
                          for slot in getattr(type(value), "__slots__", ()))
            stack.extend((f"{name}.{key}", item) for key, item in fields.items())
    return found


@pytest.mark.parametrize("config", [STANDARD_TRACE, WIDE], ids=["standard", "wide"])
@pytest.mark.parametrize("counts", [False, True], ids=["no counts", "block counts"])
@pytest.mark.parametrize("path", ["direct", "mirror", "captured", "megatron",
                                  "megatron engine"])
def test_no_tensor_the_library_keeps_is_an_inference_tensor(path, counts, config):
    """Every step inside inference mode: whatever the library made on the way (staging
    stages, scratch, dtype views, a counted pass's dummy rows) is a normal tensor."""
    replay = Replay(path, config, torch.device("cpu"), depths=True, counts=counts)
    replay.reset()
    with torch.inference_mode():
        for index, step in enumerate(make_trace(config, 8, seed=4)):
            replay.prepare(index, step)
            replay.run(step)
    assert _inference_tensors(replay.meta) == []


@pytest.mark.parametrize("mirror", [False, True], ids=["direct", "mirror"])
def test_an_object_allocated_inside_inference_mode_takes_calls_outside_it(mirror):
    """``allocate`` inside inference mode (an engine that builds its context there),
    then a row move, prefix hits written in place, a commit pass and an eager draft
    loop outside it: no buffer is an inference tensor, and every byte is the
    reference's."""
    rng = np.random.default_rng(9)
    meta = MTPMetadata(**config())
    with torch.inference_mode():
        meta.allocate("cpu", mirror=mirror)
    assert _inference_tensors(meta) == []
    ref = make_reference()
    view, ref_view = make_views(meta)
    R, W, BS = meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens
    table = torch.tensor(rng.integers(0, R * W, (R, W)), dtype=torch.int32)
    for obj, target in ((meta, view), (ref, ref_view)):
        obj.request_matched_prefix_blocks[1] = 1
        obj.move_request_rows(torch.tensor([1]), torch.tensor([0]))
        counts = torch.tensor([3, 2], dtype=torch.int32)
        starts = torch.tensor([BS, 5], dtype=torch.int32)
        obj.setup_commit_pass(target, counts, table[:2], start_positions=starts,
                              inherited_blocks=obj.request_matched_prefix_blocks[:2])
        obj.end_forward()
        _two_depths(obj, target, 2, starts + counts, table)
    assert_views_equal(view, ref_view)
    assert_buffers_equal(meta, ref)


def _device_calls(rng, R, W, BS):
    """A write_token_maps and a write_mha_metadata of random inputs (all tensors)."""
    table = torch.tensor(rng.integers(0, R * W, (R, W)), dtype=torch.int32)
    count = int(rng.integers(1, 24))
    rows = torch.tensor(rng.integers(0, R, count), dtype=torch.int32)
    positions = torch.tensor(rng.integers(0, W * BS, count), dtype=torch.int32)
    inherited = torch.tensor(rng.integers(0, 2, R), dtype=torch.int32)
    yield "write_token_maps", (rows, positions, table, count + 2), dict(
        inherited_blocks=inherited)
    requests = int(rng.integers(1, R))
    queries = torch.tensor(rng.integers(1, 5, requests), dtype=torch.int32)
    keys = torch.tensor(rng.integers(1, 30, requests), dtype=torch.int32)
    yield "write_mha_metadata", (queries, keys, table[:requests], requests), {}


def _two_depths(obj, target, n, starts, table):
    """An eager draft loop of two depths over ``n`` requests."""
    obj.begin_decode(n, n, starts, table, False)
    for _ in range(2):
        obj.setup_decode_step(target)
        obj.advance_decode_step()
    obj.end_forward()


@pytest.mark.usefixtures("device_route")
def test_device_route_scratch_made_inside_inference_mode_takes_calls_outside_it():
    """Device-tensor writers and a device-input draft loop (the device route's token
    scratch, writer scratch and the loop plan's view caches, all made at their first
    call, here inside inference mode), then the same calls outside it and back."""
    rng = np.random.default_rng(7)
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=True)
    ref = make_reference()
    view, ref_view = make_views(meta)
    R, W, BS = meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens
    for inference in (True, False, True, False):
        with torch.inference_mode(inference):
            for name, args, kwargs in _device_calls(rng, R, W, BS):
                getattr(meta, name)(view, *args, **kwargs)
                getattr(ref, name)(ref_view, *args, **kwargs)
                assert_views_equal(view, ref_view)
            n = int(rng.integers(1, R + 1))
            starts = torch.tensor(rng.integers(0, W * BS - 4, R), dtype=torch.int32)
            table = torch.tensor(rng.integers(-1, R * W, (R, W)), dtype=torch.int32)
            _two_depths(meta, view, n, starts, table)
            _two_depths(ref, ref_view, n, starts, table)
            assert_views_equal(view, ref_view)
            assert_buffers_equal(meta, ref)


def test_staging_grown_inside_inference_mode_takes_calls_outside_it():
    """A token write larger than ``allocate``'s ``max_tokens`` re-sizes the staging
    ring inside inference mode; the writes after it, outside, use the new ring."""
    rng = np.random.default_rng(8)
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=True, max_tokens=8)
    ref = make_reference()
    view, ref_view = make_views(meta, max_tokens=96)
    R, W, BS = meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens
    table = torch.tensor(rng.integers(0, R * W, (R, W)), dtype=torch.int32)
    for count, inference in ((80, True), (6, False), (90, False), (7, True)):
        rows = torch.tensor(rng.integers(0, R, count), dtype=torch.int32)
        positions = torch.tensor(rng.integers(0, W * BS, count), dtype=torch.int32)
        with torch.inference_mode(inference):
            meta.write_token_maps(view, rows, positions, table, count)
            ref.write_token_maps(ref_view, rows, positions, table, count)
        assert_views_equal(view, ref_view)
