"""The trace bench's engine-placement rows: Megatron's client placement replayed through
upstream's helpers and through the ones ``patch()`` installs, every read-back answered
from the trace and counted. Counts and bytes only, never times."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import mtpmeta.bench.trace_bench as trace_bench
from mtpmeta.bench import cli as bench_cli, trace_report
from mtpmeta.bench.counters import DeviceOpCounter
from mtpmeta.bench.engine_placement import DeviceHeld, PlacementRuntime
from mtpmeta.bench.meta_device import cpp_meta_kernels
from mtpmeta.bench.trace import STANDARD_TRACE, make_trace
from mtpmeta.bench.trace_replay import Replay, check_trace, known_syncs
from mtpmeta.buffers.device_runtime import TorchRuntime, get_runtime

from tests.test_bench_trace import TINY

STEPS = 4


@pytest.fixture(scope="module")
def trace():
    return make_trace(STANDARD_TRACE, STEPS, seed=0)


def _step_counts(path, trace, device="meta", known=None, wrap=None, counts=False):
    """Per step of ``path`` on ``device``: (device data ops, syncs, bytes read back, the
    commit pass's eager attention state). On meta the patched helpers' read-backs are
    answered with ``known`` (default: what a CPU replay read)."""
    if known is None and path == "megatron engine" and device == "meta":
        known = known_syncs(STANDARD_TRACE, trace, path, counts)
    replay = Replay(path, STANDARD_TRACE, torch.device(device), known=known, counts=counts)
    if wrap is not None:
        wrap(replay.placement.engine)
    is_device = replay.runtime.is_device if replay.runtime is not None else None
    out = []
    with cpp_meta_kernels():
        replay.reset()
        for index, step in enumerate(trace):
            replay.prepare(index, step)
            reads, nbytes = replay.read_backs()
            with DeviceOpCounter(is_device) as counter:
                replay.run(step)
            after, bytes_after = replay.read_backs()
            state = replay.placement.engine.non_graph_attn_metadata["mha_metadata"].state
            out.append((counter.device_data_ops, counter.scalar_reads + after - reads,
                        bytes_after - nbytes, dict(state)))
        replay.reset()  # every known read-back of the last step was made
    return out


def _meta_counts(path, trace, known=None, wrap=None):
    """Per step: (device data ops, syncs, bytes read back) of ``path`` on meta."""
    return [counted[:3] for counted in _step_counts(path, trace, known=known, wrap=wrap)]


def _reading(helper_name, read):
    """A ``wrap`` that makes the engine's ``helper_name`` call ``read(args)`` after it."""
    def plant(engine):
        helper = getattr(engine, helper_name)

        def reading(*args, **kwargs):
            helper(*args, **kwargs)
            read(args)

        setattr(engine, helper_name, reading)

    return plant


def test_every_read_back_of_a_held_device_tensor_is_counted_with_its_bytes():
    """Each way the host can read a device tensor counts one sync and the bytes read
    (a copy: into the runtime's host memory); views, device ops and a copy into the
    library's device memory (a plain CPU tensor on a CPU replay) keep it a device
    tensor and read nothing; a ``to_host`` read's values are recorded, for the same
    read on meta."""
    runtime = PlacementRuntime(TorchRuntime())
    counts = runtime.mark(torch.arange(6, dtype=torch.int64))
    reads = [lambda: counts.cpu(), lambda: counts.tolist(), lambda: counts.numpy(),
             lambda: np.asarray(counts), lambda: counts.to("cpu"),
             lambda: runtime.host_empty((6,), torch.int64).copy_(counts),
             lambda: runtime.to_host(counts)]
    for number, read in enumerate(reads, 1):
        value = read()
        assert not isinstance(value, DeviceHeld)
        assert runtime.syncs == number and runtime.read_bytes == 48 * number
    assert len(runtime.recorded) == 1 and torch.equal(runtime.recorded[0], torch.arange(6))
    view, summed = counts[2:4], counts + 1
    assert isinstance(view, DeviceHeld) and isinstance(summed, DeviceHeld)
    assert runtime.is_device(view) and runtime.is_device(summed.sum())
    torch.empty(6, dtype=torch.int64).copy_(counts)  # device to device
    assert runtime.syncs == len(reads)  # views and device ops read nothing back
    assert int(view[0]) == 2 and view[1].item() == 3
    assert (runtime.syncs, runtime.read_bytes) == (len(reads) + 2, 48 * len(reads) + 16)
    assert not runtime.is_device(torch.arange(3))


def test_a_meta_read_back_is_answered_from_the_known_values_in_order():
    """``to_host`` of a meta tensor returns the next expected value, counted with its
    bytes; a read of another shape or dtype, a read with none left and a value left
    unread all raise; a meta tensor is a device tensor to the library, and a runtime
    that holds no tensors (a replay on meta) asks its inner runtime which are."""
    inner = TorchRuntime()
    runtime = PlacementRuntime(inner, holds=False)
    assert runtime.is_device == inner.is_device and runtime.event == inner.event
    with pytest.raises(ValueError, match="holds=False"):
        runtime.mark(torch.arange(3))
    first, second = torch.arange(4, dtype=torch.int64), torch.arange(3, dtype=torch.int32)
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    assert runtime.is_device(meta) and not runtime.is_host(meta)
    with pytest.raises(RuntimeError, match="no known value left"):
        runtime.to_host(meta)  # nothing expected
    runtime.expect([first, second])
    answer = runtime.to_host(meta)
    assert torch.equal(answer, first) and answer.device.type == "cpu"
    answer.fill_(9)  # the caller's copy: the next pass's value stays
    assert torch.equal(first, torch.arange(4))
    assert (runtime.syncs, runtime.read_bytes) == (1, 32)
    with pytest.raises(RuntimeError, match=r"known value is \(3,\) torch.int32"):
        runtime.to_host(torch.empty(3, dtype=torch.int64, device="meta"))
    runtime.expect([second])
    with pytest.raises(RuntimeError, match=r"known value is \(3,\)"):
        runtime.to_host(torch.empty(2, dtype=torch.int32, device="meta"))
    runtime.expect([second])
    with pytest.raises(RuntimeError, match="1 known read-back.* left unread"):
        runtime.expect(None)
    runtime.to_host(torch.empty(3, dtype=torch.int32, device="meta"))
    assert (runtime.syncs, runtime.read_bytes) == (2, 44)
    with pytest.raises(RuntimeError, match="no known value left"):
        runtime.to_host(torch.empty(3, dtype=torch.int32, device="meta"))
    runtime.expect(None)


@pytest.mark.parametrize("counts", [True, False])
def test_the_meta_replay_reads_back_what_the_cpu_replay_read(trace, counts):
    """Per step, the patched helpers on meta (device inputs real meta tensors) make the
    CPU replay's read-backs (held device tensors): the same syncs and bytes, and the
    answered values give the commit pass the same attention bounds."""
    cpu = _step_counts("megatron engine", trace, "cpu", counts=counts)
    meta = _step_counts("megatron engine", trace, counts=counts)
    assert [counted[1:] for counted in meta] == [counted[1:] for counted in cpu]
    for step, (ops, syncs, nbytes, state) in zip(trace, meta):
        assert (syncs, nbytes) == (1, 16 * step.append_counts.numel())
        assert ops > 0 and state["max_seqlen_q"] == int(step.append_counts.max())


def _altered(known, index, change):
    out = [list(values) for values in known]
    out[index] = change(out[index])
    return out


@pytest.mark.parametrize("change, message", [
    (lambda values: [values[0][:-1]], r"known value is \("),
    (lambda values: [values[0].to(torch.int32)], "known value is .* torch.int32"),
    (lambda values: [], "no known value left"),
    (lambda values: values + values, "left unread"),
])
def test_a_known_read_back_that_does_not_match_stops_the_meta_replay(trace, change,
                                                                     message):
    """A queue whose step-1 value has another shape or dtype, or is missing, or that has
    one more value than the step reads, raises instead of answering."""
    known = known_syncs(STANDARD_TRACE, trace[:3], "megatron engine", True)
    assert all(len(values) == 1 for values in known)
    with pytest.raises(RuntimeError, match=message):
        _step_counts("megatron engine", trace[:3], known=_altered(known, 1, change),
                     counts=True)


def test_an_extra_read_back_on_meta_stops_the_replay(trace):
    """A read the CPU replay did not make cannot be answered on meta: through the
    runtime's ``to_host`` it finds no known value left, through a tensor method it
    cannot run; either way the replay stops."""
    known = known_syncs(STANDARD_TRACE, trace[:2], "megatron engine", True)
    extra = _reading("_mtp_setup_prefill_step",
                     lambda args: get_runtime().to_host(args[0]))
    with pytest.raises(RuntimeError, match="no known value left"):
        _step_counts("megatron engine", trace[:2], known=known, wrap=extra, counts=True)
    listed = _reading("_mtp_setup_prefill_step", lambda args: args[0].tolist())
    with pytest.raises(NotImplementedError, match="meta"):
        _step_counts("megatron engine", trace[:2], known=known, wrap=listed, counts=True)


def test_the_counting_catches_a_planted_extra_read_back(trace):
    """Negative control, on the CPU replay whose reads the meta replay answers: the
    patched commit helper made to read its counts back once more (a ``.tolist()``)
    shows one more sync and 8 B per request more per step."""
    plain = _step_counts("megatron engine", trace, "cpu")
    planted = _step_counts("megatron engine", trace, "cpu", wrap=_reading(
        "_mtp_setup_prefill_step", lambda args: args[0].tolist()))
    for step, (_, syncs, nbytes, _), (_, more_syncs, more_bytes, _) in zip(trace, plain,
                                                                           planted):
        assert more_syncs == syncs + 1
        assert more_bytes == nbytes + 8 * step.append_counts.numel()


def test_a_read_back_of_a_meta_tensor_stops_the_replay(trace):
    """A read-back no one answers cannot pass uncounted: on meta it raises."""
    planted = _reading("_mtp_begin_decode",
                       lambda args: args[2][:1].sum().item())  # the device start positions
    with pytest.raises(RuntimeError, match=r"item\(\) cannot be called on meta"):
        _step_counts("megatron engine", trace[:1], wrap=planted)


def test_upstream_helpers_on_the_placement_sync_once_per_commit(trace):
    """Upstream's helpers given ``total`` read back one value per commit pass (the
    longest length, 4 B) and none in a graphed draft loop; they launch far more device
    ops than the patched helpers on the same placement."""
    known = known_syncs(STANDARD_TRACE, trace, "upstream engine")
    assert all(len(values) == 1 for values in known)
    upstream = _meta_counts("upstream engine", trace, known=known)
    assert all((syncs, nbytes) == (1, 4) for _, syncs, nbytes in upstream)
    patched = _meta_counts("megatron engine", trace)
    for (ops, _, _), (upstream_ops, _, _) in zip(patched, upstream):
        assert 0 < ops < upstream_ops


def test_the_patched_helpers_bytes_read_back_are_what_they_read(trace):
    """The patched helpers read the client's device inputs back in one packed read a
    step: the counts and starts (int64, ``16 * A`` bytes), never the ``[A, W]`` table,
    and nothing in the graphed draft loop on device start positions."""
    for step, (_, syncs, nbytes) in zip(trace, _meta_counts("megatron engine", trace)):
        requests = step.append_counts.numel()
        assert syncs == 1
        assert nbytes == 16 * requests


def test_the_engine_placement_rows_are_checked_against_the_reference(trace,
                                                                     monkeypatch):
    """check_trace's default paths replay both engine-placement paths; a patched
    replay given another context table at step 2 is caught and named."""
    assert check_trace(STANDARD_TRACE, trace[:3], counts=(), device_inputs=False) is None
    prepare = Replay.prepare

    def planting(self, index, step):
        prepare(self, index, step)
        if self.path == "megatron engine" and index == 2:
            valid = int(step.block_counts[0])
            self.table[0, :valid] = self.table[0, :valid].flip(0).clone()
            self.placement.prepare(step)  # the client copies the table it has

    monkeypatch.setattr(Replay, "prepare", planting)
    message = check_trace(STANDARD_TRACE, trace[:3], paths=("megatron engine",),
                          counts=(), device_inputs=False)
    assert message is not None and "megatron engine" in message, message


def test_rows_for_the_engine_placement_take_upstreams_helpers_as_reference():
    for name in ("standard", "production"):
        keys = {row.key: row for row in trace_bench.rows_for(name)}
        for key in (trace_report.ENGINE_KEY, trace_report.ENGINE_BYTE_EXACT_KEY):
            assert keys[key].baseline_key == trace_report.ENGINE_REFERENCE_KEY
            assert keys[key].path == "megatron engine"
        assert not keys[trace_report.ENGINE_BYTE_EXACT_KEY].block_counts
        assert keys[trace_report.ENGINE_KEY].block_counts is True


def _row(label, path, us, syncs, ops, d2h=0.0):
    return {"label": label, "path": path, "device": "meta", "median_us": us,
            "speedup_vs_reference": 1000 / us, "syncs": syncs, "d2h_bytes": d2h,
            "device_data_ops": ops}


def test_verdict_and_engine_line_put_the_placement_beside_upstreams_helpers():
    rows = {trace_report.ENGINE_REFERENCE_KEY: _row("reference, engine placement",
                                                    "upstream engine", 1000, 1, 175, 4),
            trace_report.ENGINE_KEY: _row("megatron, engine placement",
                                          "megatron engine", 250, 3, 13.5, 81840),
            trace_report.ENGINE_BYTE_EXACT_KEY: _row(
                "megatron, engine placement, byte-exact", "megatron engine", 2000, 3, 13.5,
                81840),
            "reference @meta": _row("reference", "reference", 1000, 2, 170),
            "mirror @meta": _row("mirror", "mirror", 500, 0, 13)}
    line = " ".join(trace_report.engine_line(rows).split())
    assert ("patch()'s helpers 3.00 syncs, 81,840 B read back, 13.5 device data ops; "
            "byte-exact 3.00 syncs, 81,840 B read back, 13.5 device data ops; upstream's "
            "helpers 1.00 syncs, 4 B read back, 175.0 device data ops") in line
    verdict = trace_report.verdict_line({"standard": {"rows": rows}}, {"standard": 4})
    assert ("standard megatron, engine placement 4.00x (3.00 syncs per step against "
            "upstream's 1.00), mirror 2.00x") in verdict
    targets = trace_report.trace_target_lines({"standard": {"rows": rows}})
    assert targets[0].endswith("4.00x its reference (target >= 3.5x): met")
    assert any("3.00 syncs and 13.5 device data ops per step against upstream's 1.00 "
               "and 175.0" in line and line.endswith("MISSED") for line in targets)


def test_trace_default_output_has_no_targets_and_warns_when_busy(monkeypatch, capsys):
    """Without --targets the trace prints no goal; on a busy machine it warns as the
    standard bench does (one route: ``measure.machine_load``, ``report.load_lines``);
    --targets prints the trace targets."""
    from mtpmeta.bench import measure

    monkeypatch.setattr(trace_bench, "trace_geometries",
                        lambda quick: {"standard": (TINY, 2)})
    monkeypatch.setattr(measure, "machine_load", lambda before: {
        "before": 3.0, "after": 3.5, "cpus": 2, "busy": True})
    assert bench_cli.main(["--trace", "--quick", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"target|MISSED|\bmet\b", out)
    assert "WARNING: the machine is busy" in out
    assert re.search(r"megatron, engine placement +meta", out)
    monkeypatch.setattr(measure, "machine_load", lambda before: {
        "before": 0.2, "after": 0.3, "cpus": 2, "busy": False})
    assert bench_cli.main(["--trace", "--quick", "--repeats", "1", "--targets"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out
    assert "trace targets (maintainers' performance goals" in out
    assert any(line.startswith("target: standard: megatron, engine placement ")
               for line in out.splitlines())
    assert out.splitlines()[-1].startswith("verdict: ")
