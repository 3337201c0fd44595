"""The seeded trace of ``mtpmeta bench --trace``: its generator, its replay, the
meta-device setup and the command line. Counts and bytes only, never times."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mtpmeta.bench.trace_bench as trace_bench
import mtpmeta.bench.trace_replay as trace_replay
import mtpmeta.bench.trace_report as trace_report
from mtpmeta.bench import cli as bench_cli
from mtpmeta.bench.counters import CountingRuntime, OpCounter
from mtpmeta.bench.meta_device import cpp_meta_kernels, python_meta_active
from mtpmeta.bench.trace import PRODUCTION_TRACE, STANDARD_TRACE, TraceConfig, \
    make_trace, trace_shape_stats
from mtpmeta.bench.trace_replay import Replay, check_trace, known_syncs
from mtpmeta.buffers.device_runtime import use_runtime


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _same_trace(one, other) -> bool:
    return len(one) == len(other) and all(
        _equal(getattr(a, f.name), getattr(b, f.name))
        for a, b in zip(one, other) for f in fields(a))


@pytest.fixture(scope="module")
def standard():
    return make_trace(STANDARD_TRACE, seed=0)


def test_trace_is_deterministic_for_a_seed(standard):
    assert _same_trace(make_trace(STANDARD_TRACE, 60, seed=0), standard[:60])
    assert not _same_trace(make_trace(STANDARD_TRACE, 60, seed=1), standard[:60])


def test_standard_trace_changes_shape_every_step(standard):
    """320 steps: n wanders, many (n, padded) pairs and commit sizes, every kind of
    call occurs, and almost no two consecutive steps share (n, tokens)."""
    stats = trace_shape_stats(standard)
    assert stats["steps"] == 320
    assert 145 <= stats["active_min"] and stats["active_max"] <= 220
    assert stats["active_max"] - stats["active_min"] >= 25
    assert stats["distinct_n_padded"] >= 25 and stats["distinct_commit_tokens"] >= 150
    for kind in ("moves", "swaps", "resets", "carries", "prefix_hits"):
        assert stats[kind] >= 20, (kind, stats)
    repeats = sum((a.active, a.token_count) == (b.active, b.token_count)
                  for a, b in zip(standard, standard[1:]))
    assert repeats <= 5
    assert {s.padded % 8 for s in standard} == {0}
    assert all(s.padded_tokens % 8 == 0 and s.padded_tokens >= s.token_count
               for s in standard)
    accepted = torch.cat([s.append_counts[:s.active] for s in standard])
    assert set(accepted.tolist()) == set(range(1, STANDARD_TRACE.depths + 2))


def test_production_trace_spans_its_batch_range():
    stats = trace_shape_stats(make_trace(PRODUCTION_TRACE, seed=0))
    assert stats["steps"] == 160
    assert 580 <= stats["active_min"] and stats["active_max"] <= 850
    assert stats["active_max"] - stats["active_min"] >= 100
    assert stats["distinct_n_padded"] >= 60


def test_replay_leaves_every_path_byte_equal_to_the_reference(standard):
    assert check_trace(STANDARD_TRACE, standard[:24]) is None


@st.composite
def _small_traces(draw):
    """A small geometry (R 1..32, W 2..16, BS 4..16, K 1..3) whose starting rows fit,
    lengths scaled to the rows."""
    rows = draw(st.sampled_from([1, 3, 4, 8, 13, 32]))
    width = draw(st.sampled_from([2, 4, 8, 16]))
    block = draw(st.sampled_from([4, 8, 16]))
    depths = draw(st.integers(1, 3))
    if width * block < 3 * depths + 4:
        width = 4
    active = draw(st.integers(0, rows))
    tokens = width * block
    return TraceConfig(max_requests=rows, block_columns=width, block_size=block,
                       depths=depths, steps=16, start_active=active,
                       start_paused=draw(st.integers(0, rows - active)),
                       chunk_tokens=draw(st.sampled_from([8, 24, 64])),
                       prompt_median=tokens / 4, output_median=tokens / 2,
                       context_median=tokens / 3, hidden_size=8,
                       arrival_rate=draw(st.sampled_from([0.2, 1.0, 3.0])),
                       swap_rate=draw(st.sampled_from([0.0, 0.5])))


@settings(max_examples=25, deadline=None)
@given(config=_small_traces(), seed=st.integers(0, 2**16))
def test_small_geometry_traces_replay_equal_to_the_reference(config, seed):
    """The engine model on a few rows and columns (every row busy, no row busy, R
    under the bucket of 8): each path, with and without counts and with device inputs,
    leaves the reference's view and buffers on every step."""
    trace = make_trace(config, seed=seed)
    assert len(trace) == config.steps
    assert all(s.padded <= config.max_requests and s.padded_requests
               <= config.max_requests for s in trace)
    assert check_trace(config, trace) is None


@pytest.mark.parametrize("change, named", [
    ({"start_active": 6, "start_paused": 3}, "max_requests 8"),
    ({"start_active": -1}, "start_active -1"),
    ({"block_columns": 1, "block_size": 4}, "4 tokens per row"),
    ({"chunk_tokens": 0}, "chunk_tokens 0"),
    ({"pool_columns": 1, "block_columns": 64, "context_median": 200.0}, "block pool"),
])
def test_trace_refuses_a_geometry_its_engine_cannot_run(change, named):
    config = TraceConfig(**{**TraceConfig().__dict__, "max_requests": 8, "block_columns": 8,
                            "block_size": 16, "start_active": 4, "start_paused": 1,
                            "steps": 8, **change})
    with pytest.raises(ValueError, match=named):
        make_trace(config)


def test_agreement_check_catches_a_path_given_another_table(standard, monkeypatch):
    """Negative control: at step 5 the mirror replay's table row 0 holds its blocks in
    reverse order (still valid ids), so its view must differ from the reference's."""
    prepare = Replay.prepare

    def planting(self, index, step):
        prepare(self, index, step)
        if self.path == "mirror" and index == 5:
            valid = int((self.table[0] >= 0).sum())
            assert valid >= 2
            self.table[0, :valid] = self.table[0, :valid].flip(0).clone()

    monkeypatch.setattr(Replay, "prepare", planting)
    message = check_trace(STANDARD_TRACE, standard[:8])
    assert message is not None and "mirror" in message and "step 5" in message


def test_agreement_check_catches_the_engine_path_given_another_table(standard,
                                                                     monkeypatch):
    """Negative control for the ``megatron`` row: at step 2 the engine context's
    ``request_to_kv_block_ids`` row 0 holds its blocks in reverse order (still valid
    ids), so the view the patched helpers write must differ from the reference's."""
    prepare = Replay.prepare

    def planting(self, index, step):
        prepare(self, index, step)
        if self.engine is not None and index == 2:
            table = self.engine.request_to_kv_block_ids
            valid = int((table[0] >= 0).sum())
            assert valid >= 2
            table[0, :valid] = table[0, :valid].flip(0).clone()

    assert check_trace(STANDARD_TRACE, standard[:4], paths=("megatron",)) is None
    monkeypatch.setattr(Replay, "prepare", planting)
    message = check_trace(STANDARD_TRACE, standard[:4], paths=("megatron",))
    assert message is not None and "megatron" in message and "step 2" in message


def _stock_meta(call):
    out = call()
    return tuple(out.shape), out.dtype


_REDIRECTED = {
    "floor_divide": lambda: torch.ones(7, dtype=torch.int64, device="meta") // 64,
    "floor_divide.Tensor": lambda: torch.floor_divide(
        torch.ones(7, 1, device="meta"), torch.ones(3, dtype=torch.int32, device="meta")),
    "index_select": lambda: torch.ones(5, 4, device="meta").index_select(
        0, torch.zeros(9, dtype=torch.int64, device="meta")),
    "where": lambda: torch.where(torch.ones(6, 1, dtype=torch.bool, device="meta"),
                                 torch.ones(3, dtype=torch.int32, device="meta"),
                                 torch.ones(3, dtype=torch.int64, device="meta")),
    "max": lambda: torch.ones(6, dtype=torch.int32, device="meta").max(),
    "repeat_interleave": lambda: torch.repeat_interleave(
        torch.arange(4, device="meta"), torch.ones(4, dtype=torch.int64, device="meta"),
        output_size=11),
}


def test_meta_setup_drops_the_python_registrations_and_restores_them():
    """Inside the block the Python meta library is gone (the C++ kernels serve), the
    thin kernels size outputs exactly as the Python ones did; after it, even after an
    exception, every Python registration is back."""
    import torch._meta_registrations as registrations

    assert python_meta_active()
    before = set(registrations._meta_lib_dont_use_me_use_register_meta._op_impls)
    expected = {name: _stock_meta(call) for name, call in _REDIRECTED.items()}
    with pytest.raises(KeyError):
        with cpp_meta_kernels() as info:
            assert not python_meta_active()
            assert "floor_divide" in info["redirected"]
            assert torch.cumsum(torch.ones(5, device="meta"), 0).shape == (5,)
            assert {name: _stock_meta(call) for name, call in _REDIRECTED.items()} == expected
            raise KeyError("leave the block by an exception")
    assert python_meta_active()
    assert set(registrations._meta_lib_dont_use_me_use_register_meta._op_impls) == before
    assert {name: _stock_meta(call) for name, call in _REDIRECTED.items()} == expected


def test_meta_reference_answers_upstream_syncs_from_the_host(standard):
    """On meta the reference cannot read back (.item()); with the host's values it
    replays the trace, patching exactly the syncs the CPU reference makes."""
    steps = standard[:6]
    known = known_syncs(STANDARD_TRACE, steps)
    cpu = Replay("reference", STANDARD_TRACE, torch.device("cpu"))
    with OpCounter() as counter:
        cpu.replay(steps)
    with cpp_meta_kernels():
        blind = Replay("reference", STANDARD_TRACE, torch.device("meta"))
        blind.prepare(0, steps[0])
        with pytest.raises(RuntimeError, match="meta"):  # .item() on meta
            blind.run(steps[0])
        meta = Replay("reference", STANDARD_TRACE, torch.device("meta"), known=known)
        meta.replay(steps)
    assert meta.meta.patched == counter.scalar_reads == sum(map(len, known)) >= 2 * 6


def test_mirror_on_meta_counts_event_and_stream_calls(standard):
    runtime = CountingRuntime()
    with cpp_meta_kernels():
        with use_runtime(runtime):
            replay = Replay("mirror", STANDARD_TRACE, torch.device("meta"))
        replay.replay(standard[:4])
    assert runtime.calls["event.record"] >= 4 and runtime.calls["current_stream"] >= 4


#: A trace small enough that the command's check and timing take a second or two.
TINY = TraceConfig(max_requests=16, block_columns=8, block_size=8, depths=2, steps=6,
                   start_active=6, start_paused=2, chunk_tokens=16, prompt_median=16.0,
                   output_median=24.0, context_median=20.0, hidden_size=8,
                   arrival_rate=1.0)
TINY_WIDE = TraceConfig(**{**TINY.__dict__, "block_columns": 32, "pool_columns": 8})
TINY_GEOMETRIES = {"standard": (TINY, 6), "production": (TINY, 3),
                   "production W 8192": (TINY_WIDE, 3)}


def test_cli_trace_prints_every_geometry_and_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(trace_bench, "trace_geometries", lambda quick: TINY_GEOMETRIES)
    path = tmp_path / "trace.json"
    assert bench_cli.main(["--trace", "--quick", "--repeats", "1", "--json",
                           str(path)]) == 0
    out = capsys.readouterr().out
    for name in TINY_GEOMETRIES:
        assert f"trace, {name} geometry" in out
    for row in ("reference", "direct", "mirror", "captured", "mirror, device inputs",
                "drop-in, device inputs", "megatron, patched helpers"):
        assert f"  {row} " in out
    result = json.loads(path.read_text())["trace"]
    assert set(result) == set(TINY_GEOMETRIES)
    rows = result["standard"]["rows"]
    assert {"reference @meta", "mirror @meta", "captured @meta", "direct @cpu",
            "mirror, device inputs @meta"} <= set(rows)
    for row in rows.values():
        assert {"median_us", "p90_us", "speedup_vs_reference", "device_data_ops",
                "syncs"} <= set(row)
    assert rows["reference @meta"]["syncs"] >= 2 and rows["mirror @meta"]["syncs"] == 0
    engine = rows[trace_bench.MEGATRON_KEY]  # the patched helpers read nothing back
    assert engine["syncs"] == 0
    # patch()'s default passes the context's block counts to the commit pass
    assert engine["device_data_ops"] == rows["mirror, block counts @meta"]["device_data_ops"]
    assert rows["mirror @meta"]["runtime_calls"]["total"] > 0
    assert set(result["production W 8192"]["rows"]) == {
        row.key for row in trace_bench.rows_for("production W 8192")}


def test_cli_trace_reports_progress_first_and_each_section_as_it_goes(monkeypatch,
                                                                      capsys):
    """``--trace`` ran for minutes with no output and ended without a verdict. Now its
    first progress line is out before any trace work starts, each geometry announces
    its check and its timing on stderr before doing them and prints its result on
    stdout as soon as it has it, and stdout ends with the verdict."""
    monkeypatch.setattr(trace_bench, "trace_geometries", lambda quick: TINY_GEOMETRIES)
    seen_before_work = []
    real_check = trace_replay.check_trace

    def check(config, trace, **kwargs):
        captured = capsys.readouterr()  # what was printed before this section's work
        seen_before_work.append((captured.out, captured.err))
        return real_check(config, trace, **kwargs)

    monkeypatch.setattr(trace_replay, "check_trace", check)
    assert bench_cli.main(["--trace", "--quick", "--repeats", "1"]) == 0
    rest = capsys.readouterr()
    first_out, first_err = seen_before_work[0]
    assert first_out == ""
    assert first_err.splitlines()[0].startswith("mtpmeta bench: trace: 3 geometries")
    assert first_err.splitlines()[-1] == ("mtpmeta bench: standard trace: checking "
                                          "upstream engine, megatron engine, mirror, "
                                          "captured, megatron, drop-in, direct against "
                                          "the reference on 6 steps ...")
    # Before the production check: the standard geometry's results are already out.
    out_before_production = seen_before_work[1][0]
    assert ("standard trace: upstream engine, megatron engine, mirror, captured, "
            "megatron, drop-in, direct" in out_before_production)
    assert "trace, standard geometry" in out_before_production
    err = "".join(e for _, e in seen_before_work) + rest.err
    for name in TINY_GEOMETRIES:
        assert f"mtpmeta bench: {name} trace: timing " in err
        assert f"mtpmeta bench: {name} trace: pass 1 of 1 ..." in err
    assert all(line.startswith("mtpmeta bench: ") for line in err.splitlines())
    out = "".join(o for o, _ in seen_before_work) + rest.out
    lines = out.splitlines()
    assert any(line.startswith("capacity, µs per step at W 32 over W 8 on the same "
                               "traffic: mirror ")
               and ", mirror, block counts " in line for line in lines), lines
    assert lines[-1].startswith("verdict: every timed path left the reference's views "
                                "and buffers on the checked trace steps (standard 6, "
                                "production 3, production W 8192 3; CPU)"), lines[-1]
    for name in TINY_GEOMETRIES:
        assert re.search(f"(: |; ){name} [^;]*mirror [0-9]", lines[-1]), name
    for name in ("standard", "production"):  # the geometries the engine row is timed on
        assert re.search(f"{name} megatron, engine placement [0-9.]+x( slower)? "
                         f"\\([0-9.]+ syncs per step against upstream's [0-9.]+\\)",
                         lines[-1]), lines[-1]
        assert re.search(f"{name} [^;]*megatron, patched helpers [0-9.]+x( slower)? "
                         "\\([0-9.]+x (faster|slower) than the mirror path\\)",
                         lines[-1]), lines[-1]
    assert "; µs per step at W 32 over W 8 on the same traffic: mirror " in lines[-1]


def test_every_timed_row_is_checked_and_has_its_baseline():
    """A row added to ROWS is checked against the reference before it is timed (the
    check replays every path, count and thread setting the geometry's rows time), and
    its baseline (the reference on the same device and inputs) is timed beside it."""
    from mtpmeta.bench.trace_replay import PATHS

    for name in ("standard", "production", "production W 8192"):
        rows = trace_bench.rows_for(name)
        keys = {row.key for row in rows}
        arguments = trace_bench._check_arguments(rows)
        for row in rows:
            assert row.path in PATHS
            assert row.baseline_key in keys, (name, row)
            if row.path != "reference":
                assert row.path in arguments["paths"]
            if row.block_counts:
                assert row.path in arguments["counts"]


def test_verdict_names_the_patched_helpers_once_with_their_ratio_to_the_mirror_path():
    """The engine row is shown once, with its µs over the mirror path's, even when it
    is the fastest row of its geometry (which would otherwise be shown as such)."""
    def row(label, path, us):
        return {"label": label, "path": path, "device": "meta", "median_us": us,
                "speedup_vs_reference": 500 / us}

    rows = {"reference @meta": row("reference", "reference", 500),
            "mirror @meta": row("mirror", "mirror", 125),
            "captured @meta": row("captured", "captured", 250),
            trace_bench.MEGATRON_KEY: row("megatron, patched helpers", "megatron", 100)}
    line = trace_bench.verdict_line({"standard": {"rows": rows}}, {"standard": 4})
    assert line.count("megatron, patched helpers") == 1, line
    assert ("standard mirror 4.00x, captured 2.00x, megatron, patched helpers 5.00x "
            "(1.25x faster than the mirror path)") in line


def test_rows_are_timed_inside_inference_mode_and_counted_outside_it(monkeypatch):
    """Megatron's controller runs the MTP helpers inside ``torch.inference_mode()`` on
    a context built outside it: every row's objects are built outside the mode and
    every timed pass runs inside it; the ops and syncs are counted outside it, where
    torch's dispatch modes see every aten op."""
    make, timed, count = trace_bench._replay, trace_bench._timed_pass, trace_bench._counts
    modes = {"built": [], "timed": [], "counted": []}

    def recording(name, function):
        def record(*args, **kwargs):
            modes[name].append(torch.is_inference_mode_enabled())
            return function(*args, **kwargs)
        return record

    monkeypatch.setattr(trace_bench, "_replay", recording("built", make))
    monkeypatch.setattr(trace_bench, "_timed_pass", recording("timed", timed))
    monkeypatch.setattr(trace_bench, "_counts", recording("counted", count))
    rows = tuple(row for row in trace_bench.ROWS
                 if row.key in ("reference @meta", "mirror @meta"))
    trace_bench.measure_trace(TINY, 3, repeats=2, rows=rows)
    assert modes["timed"] == [True] * 4  # two rows, two passes each
    assert modes["counted"] == [False] * 2
    assert modes["built"] == [False] * 3  # and the runtime calls' replay


def test_each_pass_is_a_ratio_against_the_references_pass_of_the_same_round(
        monkeypatch):
    """``pass_speedups``: pass ``p`` of the reference over pass ``p`` of the row (each
    pass's median step), beside the median ratio; ``pass_spread`` names the lowest and
    highest, and the verdict and targets print them for the headline row."""
    make = trace_bench._replay

    def labelled(row, *args, **kwargs):
        replay = make(row, *args, **kwargs)
        replay.timed_label = row.label
        return replay

    us = {"reference": [300.0, 100.0, 200.0], "mirror": [100.0, 50.0, 50.0]}
    passes = {label: 0 for label in us}

    def timed(replay, trace):
        label = replay.timed_label
        passes[label] += 1
        return [us[label][passes[label] - 1]] * len(trace)

    monkeypatch.setattr(trace_bench, "_replay", labelled)
    monkeypatch.setattr(trace_bench, "_timed_pass", timed)
    rows = tuple(row for row in trace_bench.ROWS
                 if row.key in ("reference @meta", "mirror @meta"))
    result = trace_bench.measure_trace(TINY, 3, repeats=3, rows=rows)
    mirror = result["rows"]["mirror @meta"]
    assert mirror["pass_us"] == [100.0, 50.0, 50.0]
    assert mirror["pass_speedups"] == [3.0, 2.0, 4.0]
    assert mirror["speedup_vs_reference"] == 4.0  # median 200 over median 50
    assert result["rows"]["reference @meta"]["pass_speedups"] == [1.0, 1.0, 1.0]
    assert trace_report.pass_spread(mirror) == "passes 2.00x-4.00x"
    assert trace_report.pass_spread({"pass_speedups": [3.0]}) == ""
    engine = {**mirror, "label": "megatron, engine placement", "syncs": 1.0,
              "device_data_ops": 10.0}
    upstream = {**result["rows"]["reference @meta"], "label": "upstream", "syncs": 1.0,
                "device_data_ops": 100.0}
    out = {"standard": {"rows": {trace_report.ENGINE_KEY: engine,
                                 trace_report.ENGINE_REFERENCE_KEY: upstream}}}
    assert ("standard megatron, engine placement 4.00x (passes 2.00x-4.00x; 1.00 "
            "syncs per step against upstream's 1.00)") in trace_report.verdict_line(
                out, {"standard": 3})
    assert trace_report.trace_target_lines(out)[0] == (
        "standard: megatron, engine placement 4.00x its reference, passes 2.00x-4.00x "
        "(target >= 3.5x): met")


def test_cli_trace_exits_1_when_a_path_differs(monkeypatch, capsys):
    monkeypatch.setattr(trace_replay, "check_trace", lambda config, trace, **kw: "planted")
    monkeypatch.setattr(trace_bench, "trace_geometries",
                        lambda quick: {"standard": (TINY, 2)})
    assert bench_cli.main(["--trace", "--quick"]) == 1
    captured = capsys.readouterr()
    assert "RESULTS DIFFER (standard trace): planted" in captured.err
    assert "verdict:" not in captured.out


def test_asv_discovers_the_trace_trackers():
    """asv's discovery (as ``tests/test_asv_suite.py`` runs it, with this checkout on
    the path) finds the trace trackers."""
    pytest.importorskip("asv_runner")
    from tests.test_asv_suite import _DISCOVER, ASV_DIR

    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ASV_DIR),
                                                       str(ASV_DIR.parent))))
    found = subprocess.run([sys.executable, "-c", _DISCOVER], cwd=ASV_DIR, env=env,
                           capture_output=True, text=True, check=True).stdout.split()
    assert {"trace.TrackTraceHostShare.track_mirror_over_reference_meta",
            "trace.TrackTraceHostShare.track_captured_over_reference_meta",
            "trace.TrackTraceHostShare.track_mirror_over_reference_launch_estimate",
            "trace.TrackTraceHostShare.track_megatron_over_reference_meta",
            "trace.TrackTraceHostShare.track_megatron_over_mirror_meta",
            "trace.TrackTraceHostShare.track_engine_placement_over_upstream_meta",
            "trace.TrackTraceHostShare.track_engine_placement_syncs_per_step",
            "trace.TrackTraceHostShare.track_engine_placement_device_data_ops"} <= set(found)


def test_agreement_check_covers_the_block_count_rows(standard, monkeypatch):
    """The trace carries each row's block count (its leading non-negative entries),
    and check_trace replays the counted paths against the reference on the table with
    the dummy block past the counts: a counted mirror replay given another table at
    step 3 is caught, and named."""
    table = torch.full((STANDARD_TRACE.max_requests, STANDARD_TRACE.block_columns), -1,
                       dtype=torch.int32)
    for step in standard[:10]:
        table[step.table_rows] = step.table_values
        assert torch.equal((table >= 0).sum(1).int(), step.block_counts)
    prepare = Replay.prepare

    def planting(self, index, step):
        prepare(self, index, step)
        if self.path == "mirror" and self.counts and index == 3:
            valid = int(step.block_counts[0])
            self.table[0, :valid] = self.table[0, :valid].flip(0).clone()

    monkeypatch.setattr(Replay, "prepare", planting)
    message = check_trace(STANDARD_TRACE, standard[:5], paths=())
    assert message is not None and "mirror, block counts" in message, message
