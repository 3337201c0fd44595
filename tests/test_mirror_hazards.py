"""The mirror path's GPU hazards that plain CPU runs can still pin down.

Each test names the invariant a CUDA engineer's review found at risk; the
ordering hazards that need queued device work are in ``tests/test_cuda_sim.py``. Here:
the capture guard, the per-slot device stages and where their fences are recorded, the
stream fences record on, out-of-table device start positions, the documented read-backs
of device inputs to a commit pass, and the staging ring's size.
"""

from __future__ import annotations

import os
from typing import Any, List

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtpmeta import GraphCaptureError, MTPMetadata
from mtpmeta.bench.counters import OpCounter
from mtpmeta.buffers.device_runtime import CopyFence, TorchRuntime, use_runtime
from tests.helpers import (assert_same_state, buffer_state, config, make_metadata,
                           make_reference, make_views, view_state)


class CapturingRuntime(TorchRuntime):
    """The real runtime, except that the device's stream says it is capturing while
    ``capturing`` is set (what ``torch.cuda.graph`` makes CUDA report)."""

    capturing = False

    def is_capturing(self, device: torch.device) -> bool:
        return self.capturing


def _mirror(runtime: Any, **overrides: Any) -> MTPMetadata:
    meta = MTPMetadata(**config(**overrides))
    with use_runtime(runtime):
        meta.allocate("cpu", mirror=True)
    return meta


def _staging_calls(meta: MTPMetadata, view: Any) -> List[Any]:
    """Every public call that stages or writes device state, as zero-argument thunks."""
    R, W = meta.max_requests, meta.max_kv_block_count
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    starts = torch.tensor([1, 5, 9, 2, 3, 4, 6, 7], dtype=torch.int32)
    counts = torch.tensor([2, 3], dtype=torch.int32)
    return [
        ("begin_decode", lambda: meta.begin_decode(3, 4, starts, table, False)),
        ("begin_decode", lambda: meta.begin_decode(3, 4, starts, table, True)),
        ("begin_decode_for_capture", lambda: meta.begin_decode_for_capture(4)),
        ("advance_decode_step", meta.advance_decode_step),
        ("stage_decode_lengths", meta.stage_decode_lengths),
        ("setup_decode_step", lambda: meta.setup_decode_step(view)),
        ("stage_prefill_lengths", lambda: meta.stage_prefill_lengths(counts, 3)),
        ("setup_commit_pass", lambda: meta.setup_commit_pass(view, counts, table[:2],
                                                             padded_token_count=8)),
        ("write_token_maps", lambda: meta.write_token_maps(
            view, torch.tensor([0, 1]), torch.tensor([3, 4]), table, 4)),
        ("write_mha_metadata", lambda: meta.write_mha_metadata(view, counts, counts,
                                                               table[:2], 3)),
        ("carry_chunk_boundary", lambda: meta.carry_chunk_boundary(
            torch.ones(meta.hidden_size), 7, 11)),
    ]


def test_staging_calls_are_refused_inside_a_graph_capture_and_change_nothing():
    """Failure story: a setup call captured into a CUDA graph bakes a pinned slot, the
    captured request count and a host decision into the graph; a replay with fewer
    requests writes real KV from stale rows, and the host's offsets fall behind the
    device's. Every staging call must refuse while the stream captures, before it
    writes anything, and work again once the capture ends."""
    runtime = CapturingRuntime()
    meta = _mirror(runtime)
    view, _ = make_views(meta)
    starts = torch.tensor([1, 5, 9, 2, 3, 4, 6, 7], dtype=torch.int32)
    table = torch.arange(meta.max_requests * meta.max_kv_block_count,
                         dtype=torch.int32).view(meta.max_requests, -1)
    meta.begin_decode(3, 4, starts, table, True)  # a live draft loop to refuse inside
    before, before_view = buffer_state(meta), view_state(view)
    host_offsets = meta._backend.host_offsets.copy()
    runtime.capturing = True
    for name, call in _staging_calls(meta, view):
        with pytest.raises(GraphCaptureError, match=name):
            call()
        assert_same_state(before, buffer_state(meta))
        assert_same_state(before_view, view_state(view))
        assert np.array_equal(host_offsets, meta._backend.host_offsets), name
    runtime.capturing = False
    for _, call in _staging_calls(meta, view):
        call()


def test_graphed_depths_take_the_host_staged_route_of_eager_ones():
    """Failure story: a graphed depth took a device-op route (about 30 ops a depth, and
    what a capture of it baked in read rows [n, padded) stale from an earlier, larger
    batch). contract §9: a graphed depth's setup runs eagerly on the same host-staged route
    as an eager depth: the same torch ops, and the reference's view, also when a
    smaller batch follows a larger one."""
    meta = make_metadata("mirror")
    ref = make_reference()
    view, ref_view = make_views(meta)
    R, W = meta.max_requests, meta.max_kv_block_count
    big = torch.arange(R * W, dtype=torch.int32).view(R, W)
    ops = {}
    for graphed in (False, True):
        for n, starts in ((8, torch.full((R,), 5, dtype=torch.int32)),
                          (3, torch.zeros(R, dtype=torch.int32))):
            meta.begin_decode(n, 8, starts, big, graphed)
            ref.begin_decode(n, 8, starts, big, graphed)
            for _ in range(2):
                with OpCounter() as counter:
                    meta.setup_decode_step(view)
                ops.setdefault(graphed, set()).update(
                    name for name in counter.ops if name not in _VIEW_OPS)
                ref.setup_decode_step(ref_view)
                for f in view_state(view):
                    assert torch.equal(getattr(view, f), getattr(ref_view, f)), f
                meta.advance_decode_step()
                ref.advance_decode_step()
        assert view.token_to_block_idx[3:8].tolist() == [meta.dummy_block_idx] * 5
    # The H2D copy of the shadow, then one fused device-to-device placement.
    assert ops[True] == ops[False] == {"aten::copy_", "aten::_foreach_copy_"}


_VIEW_OPS = {"aten::view", "aten::slice", "aten::as_strided", "aten::detach",
             "aten::select", "aten::unsqueeze", "aten::expand", "aten::alias"}


class _Journal:
    """One ordered log of device reads and fence records/waits."""

    def __init__(self) -> None:
        self.entries: List[tuple] = []


class _JournalFence(CopyFence):
    def __init__(self, device, runtime, journal: _Journal) -> None:
        super().__init__(device, runtime)
        self.journal = journal

    def record(self) -> None:
        self.journal.entries.append(("record", id(self)))
        super().record()

    def wait(self) -> None:
        self.journal.entries.append(("wait", id(self)))
        super().wait()


class _JournalRuntime(TorchRuntime):
    def __init__(self, journal: _Journal) -> None:
        self.journal = journal

    def fence(self, device):
        return _JournalFence(device, self, self.journal)


class _ReadLog(TorchDispatchMode):
    """Logs, for each op, which watched byte ranges its tensor inputs start in."""

    def __init__(self, journal: _Journal, ranges: dict) -> None:
        super().__init__()
        self.journal = journal
        self.ranges = ranges  # fence id -> [(start, end) byte ranges read under it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return func(*args, **(kwargs or {}))  # a view op reads no data
        schema = func._schema.arguments
        for position, value in enumerate(args):
            if not isinstance(value, torch.Tensor) or position >= len(schema):
                continue
            info = schema[position].alias_info
            if info is not None and info.is_write:
                continue  # the destination of an in-place op is not read
            pointer = value.data_ptr()
            for fence_id, spans in self.ranges.items():
                if any(start <= pointer < end for start, end in spans):
                    self.journal.entries.append(("read", fence_id))
        return func(*args, **(kwargs or {}))


def test_each_forward_slot_has_its_own_device_stage_read_before_its_fence():
    """Failure story: one device staging buffer served every pinned slot and the fence
    was recorded after the H2D copy but before the scatter, so a forward issued on a
    second stream overwrote the stage while the first was still scattering it. Each
    slot must own its device stage, and every op reading a slot (host or device side)
    must be issued before that slot's fence is recorded."""
    journal = _Journal()
    meta = _mirror(_JournalRuntime(journal))
    view, _ = make_views(meta)
    ring = meta._backend.forward.ring
    stages = [ring.device_slots[k] for k in range(ring.num_slots)]
    assert len({stage.data_ptr() for stage in stages}) == ring.num_slots
    ranges = {}
    for k, fence in enumerate(ring.fences):
        spans = []
        for tensor in (ring.slots[k], stages[k]):
            start = tensor.data_ptr()
            spans.append((start, start + tensor.numel()))
        ranges[id(fence)] = spans
    R, W = meta.max_requests, meta.max_kv_block_count
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    meta.begin_decode(5, 8, torch.arange(R, dtype=torch.int32), table, False)
    with _ReadLog(journal, ranges):
        for _ in range(6):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.setup_commit_pass(view, torch.tensor([2, 3]), table[:2], padded_token_count=8)
        meta.write_token_maps(view, torch.tensor([0, 1]), torch.tensor([3, 4]), table, 4)
    reads = [e for e in journal.entries if e[0] == "read"]
    assert {e[1] for e in reads} == set(ranges), "every slot was used and read"
    for i, (kind, fence_id) in enumerate(journal.entries):
        if kind != "read":
            continue
        later = [e[0] for e in journal.entries[i + 1:]
                 if e[1] == fence_id and e[0] in ("record", "wait")]
        assert later and later[0] == "record", \
            f"a read of slot fence {fence_id} at journal entry {i} is not fenced"


class _StreamLog(TorchRuntime):
    """Gives the CPU an event, and logs the stream each record names."""

    def __init__(self) -> None:
        self.recorded_on: List[Any] = []
        self.asked: List[torch.device] = []

    def event(self, device):
        log = self.recorded_on

        class Event:
            def record(self, stream=None):
                log.append(stream)

            def query(self):
                return True

            def synchronize(self):
                pass

        return Event()

    def current_stream(self, device):
        self.asked.append(device)
        return ("stream of", device)


def test_fences_record_on_the_stream_of_the_buffers_device():
    """Failure story: fences recorded with ``torch.cuda.Event().record()`` land on the
    current *device's* stream; with buffers on another GPU the fence then guards the
    wrong queue and a slot is reused while its copy is pending."""
    runtime = _StreamLog()
    meta = _mirror(runtime)
    view, _ = make_views(meta)
    meta.write_token_maps(view, torch.tensor([0]), torch.tensor([3]),
                          torch.zeros((1, meta.max_kv_block_count), dtype=torch.int32), 2)
    assert runtime.recorded_on, "the forward recorded its fence"
    assert set(runtime.asked) == {meta.device}
    assert set(runtime.recorded_on) == {("stream of", meta.device)}


@pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                    reason="feeds out-of-table offsets on purpose; the debug checker "
                           "rightly flags them as a broken caller")
def test_device_start_positions_outside_the_table_write_only_the_dummy_block(device_route):
    """Failure story: device start positions cannot be checked without a sync; one past
    ``W * BS`` (or negative) made the draft depth's gather index outside the table, a
    device-side assert that kills the CUDA context. It must be clamped and its token
    sent to the dummy block, as the device-route writers already do."""
    meta = make_metadata("mirror")
    view, _ = make_views(meta)
    R, W, BS = meta.max_requests, meta.max_kv_block_count, meta.block_size_tokens
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    starts = torch.tensor([W * BS, -1, 5, W * BS - 1] + [0] * (R - 4), dtype=torch.int32)
    meta.begin_decode(4, 6, starts, table, False)
    meta.setup_decode_step(view)
    D = meta.dummy_block_idx
    assert view.token_to_block_idx[:6].tolist() == [D, D, int(table[2, 1]),
                                                    int(table[3, W - 1]), D, D]
    meta.advance_decode_step()  # row 1 back at position 0; row 3 one past the table
    meta.setup_decode_step(view)
    assert view.token_to_block_idx[:4].tolist() == [D, int(table[1, 0]), int(table[2, 1]),
                                                    D]


class _FakeDeviceTensor(torch.Tensor):
    """A CPU tensor that reports a CUDA device and counts its ``.cpu()`` read-backs."""

    read_backs = 0

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cpu(self):
        return False

    def cpu(self):
        _FakeDeviceTensor.read_backs += 1
        return self.as_subclass(torch.Tensor)


def test_commit_pass_reads_back_each_device_input_once_as_documented():
    """A commit pass needs its counts, positions, table and inherited counts on the
    host (to stage and to return the ForwardShape). Device inputs are read back with
    one ``.cpu()`` each, the syncs ``setup_commit_pass``'s docstring lists, and give the
    same view as host inputs."""
    meta = make_metadata("mirror")
    view, host_view = make_views(meta)
    other = make_metadata("mirror")
    counts = torch.tensor([2, 3, 1], dtype=torch.int32)
    table = torch.arange(3 * meta.max_kv_block_count, dtype=torch.int32).view(3, -1)
    starts = torch.tensor([4, 0, 9], dtype=torch.int32)
    inherited = torch.tensor([1, 0, 2], dtype=torch.int32)
    fake = [t.as_subclass(_FakeDeviceTensor) for t in (counts, table, starts, inherited)]
    _FakeDeviceTensor.read_backs = 0
    shape = meta.setup_commit_pass(view, fake[0], fake[1], start_positions=fake[2],
                                   inherited_blocks=fake[3], padded_token_count=8)
    assert _FakeDeviceTensor.read_backs == 4
    expected = other.setup_commit_pass(host_view, counts, table, start_positions=starts,
                                       inherited_blocks=inherited, padded_token_count=8)
    assert shape == expected
    for name, value in view_state(view).items():
        assert torch.equal(value, getattr(host_view, name)), name
    assert "sync" in MTPMetadata.setup_commit_pass.__doc__


@pytest.mark.parametrize("slots", [0, 1, 65, "4"])
def test_staging_slots_outside_its_range_is_refused(slots):
    meta = MTPMetadata(**config())
    with pytest.raises(ValueError, match="staging_slots"):
        meta.allocate("cpu", mirror=True, staging_slots=slots)
    assert meta.offsets is None


@pytest.mark.parametrize("slots", [2, 7])
def test_staging_slots_sizes_every_staging_ring(slots):
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=True, staging_slots=slots)
    backend = meta._backend
    for ring in (backend.begin.ring, backend.prefill_lengths.ring, backend.forward.ring):
        assert ring.num_slots == slots
