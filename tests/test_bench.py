"""The bench command and the standard-step workload.

Failure stories: a workload that changes between runs makes asv history meaningless;
a bench that keeps timing after the implementations disagree reports speed-ups of
wrong code.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from mtpmeta.bench import cli as bench, measure as bench_measure, variants as bench_variants
from mtpmeta.__main__ import main as cli_main
from mtpmeta.reference import ReferenceMTPMetadata
from mtpmeta.bench.workload import StepConfig, make_steps

SMALL_FLAGS = ["--max-requests", "32", "--active", "16", "--block-columns", "16",
               "--block-size", "16", "--prefill-tokens", "32", "--depths", "2",
               "--steps", "2", "--repeats", "1", "--no-cold-start", "--quick"]


def _flatten(step):
    return [np.asarray(value) for value in vars(step).values()
            if isinstance(value, (np.ndarray, torch.Tensor, int))]


def test_standard_workload_is_deterministic_for_a_seed():
    first = make_steps(StepConfig(), 3, seed=7)
    second = make_steps(StepConfig(), 3, seed=7)
    other = make_steps(StepConfig(), 3, seed=8)
    for a, b in zip(first, second):
        for x, y in zip(_flatten(a), _flatten(b)):
            assert np.array_equal(x, y)
    assert any(not np.array_equal(x, y)
               for x, y in zip(_flatten(first[0]), _flatten(other[0])))


def test_standard_step_matches_the_documented_shape():
    config = StepConfig()
    step = make_steps(config, 1)[0]
    assert (config.max_requests, config.block_columns, config.block_size) == (256, 128, 64)
    assert step.start_positions.shape == (192,)
    assert step.append_counts.shape == (193,)
    assert int(step.append_counts[-1]) == 256 and int(step.inherited[-1]) == 8
    assert 1 <= int(step.append_counts[:-1].min()) and int(step.append_counts[:-1].max()) <= 4
    assert step.padded_tokens % 8 == 0 and step.padded_tokens >= int(step.append_counts.sum())
    assert (len(step.move_src), len(step.swap_src), len(step.reset_rows)) == (16, 4, 16)


def test_standard_step_passes_the_seeds_input_types():
    """The bench measured numpy inputs while schedulers pass torch tensors (the seed's
    types), so it measured a friendlier library than users get. Every index, count,
    position and table input is a torch CPU tensor of a scheduler's dtype, the row and
    per-request inputs are slices of larger tensors, the table is the whole [R, W]."""
    config = StepConfig()
    step = make_steps(config, 1)[0]
    for name in ("move_src", "move_dst", "swap_src", "swap_dst", "reset_rows"):
        value = getattr(step, name)
        assert type(value) is torch.Tensor and value.dtype == torch.int64, name
    for name in ("start_positions", "block_table", "append_counts", "commit_starts",
                 "inherited"):
        value = getattr(step, name)
        assert type(value) is torch.Tensor and value.dtype == torch.int32, name
    for name in ("move_src", "move_dst", "swap_src", "swap_dst", "start_positions",
                 "append_counts", "commit_starts", "inherited"):
        assert getattr(step, name)._base is not None, f"{name} is not a slice"
    assert step.block_table.shape == (config.max_requests, config.block_columns)
    assert step.hidden.shape == (1, 1, config.hidden_size)


def test_step_config_refuses_more_active_requests_than_slots():
    with pytest.raises(ValueError, match="max_requests"):
        StepConfig(max_requests=8, active=8)


def test_bench_cli_writes_json_with_every_implementation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", *SMALL_FLAGS, "--json", str(out)]) == 0
    new_view = json.loads(out.read_text())["new_view"]
    assert set(new_view) == {f"{call}_{when}_ms" for call in ("commit_pass", "draft_depth")
                             for when in ("first", "warm")}
    assert all(value > 0 for value in new_view.values())
    results = json.loads(out.read_text())["results"]
    assert {row["impl"] for row in results.values()} == {"reference", "direct", "mirror"}
    assert {(row["inputs"], row["draft"]) for row in results.values()} == {
        (inputs, draft) for inputs in ("torch", "numpy") for draft in ("eager", "graphed")}
    for row in results.values():
        if row["impl"] == "reference":
            assert row["inputs"] == "torch"  # the seed's types: the baseline of every row
            # eager: one max per depth (2 depths); graphed depths report the capture-time
            # bound, no read; the commit pass reads its total and its maximum.
            depths = 2 if row["draft"] == "eager" else 0
            assert row["syncs_per_step"] == depths + 2
        else:
            assert row["syncs_per_step"] == 0, row
            assert row["draft_loop_allocations"] == 0, row
        assert row["data_ops_per_step"] <= row["ops_per_step"]
        # The fence-stall column: mirror rows only (CPU fences never block).
        assert row["fence_stalls_per_step"] == (0 if row["impl"] == "mirror" else None)
    captured = capsys.readouterr()
    printed = captured.out
    assert "views identical" in printed and "speed-up" in printed
    assert "new view (mirror path, CPU, kernels warm): first commit pass" in printed
    assert "fence stalls/step" in printed
    assert "captured draft loop (capture_setup=True)" in printed
    # The default output holds no development goal: no targets, met or missed (they
    # are for maintainers, --targets); stdout ends with the verdict; progress goes to
    # stderr only.
    assert "targets" not in json.loads(out.read_text())
    assert not re.search(r"target|MISSED|\bmet\b", printed), printed
    lines = printed.splitlines()
    assert lines[-2] == f"wrote {out}"
    assert re.fullmatch(r"verdict: direct and mirror wrote the reference's views and "
                        r"buffers on all 2 checked steps \(torch and numpy inputs, eager "
                        r"and graphed\); host time per step, torch inputs, eager: direct "
                        r"\d+\.\dx (faster|slower) than the reference, "
                        r"mirror \d+\.\dx (faster|slower) than the reference",
                        lines[-1]), lines[-1]
    progress = captured.err.splitlines()
    assert progress[0] == ("mtpmeta bench: checking reference, direct, mirror against each "
                           "other on 2 steps ...")
    assert "mtpmeta bench: timing 1 interleaved passes of every row (2 steps each) ..." \
        in progress
    assert all(line.startswith("mtpmeta bench: ") for line in progress), progress
    assert "mtpmeta bench: " not in printed.replace("mtpmeta bench: standard step", "")


def test_targets_flag_prints_each_target_under_its_note(capsys):
    """--targets prints each target's line with its figures under the note that says
    what the targets guard and that a miss is no wrong result; the verdict still ends
    stdout."""
    assert bench.main([*SMALL_FLAGS, "--targets"]) == 0
    out = capsys.readouterr().out
    assert "MISSED means slower" in out and "maintainers' performance goals" in out
    lines = out.splitlines()
    assert sum(line.startswith("target: ") for line in lines) == 4
    assert lines[-1].startswith("verdict: direct and mirror wrote")


def test_ratios_below_one_read_as_slower():
    """A speed-up under 1 is printed as the slow-down it is, in tables and sentences
    alike; at or above 1 it is the plain multiple."""
    from mtpmeta.bench.report import speed, versus

    assert speed(4.336) == "4.34x" and speed(1.0) == "1.00x"
    assert speed(0.5) == "2.00x slower" and speed(0.73, 1) == "1.4x slower"
    assert versus(3.2, digits=1) == "3.2x faster than the reference"
    assert versus(0.25, "the mirror path") == "4.00x slower than the mirror path"


def test_bench_on_a_gpu_compares_the_reference_with_the_mirror_path():
    """`mtpmeta bench --device cuda` used to build the direct path on CUDA, which
    allocate(..., mirror=False) refuses, so the GPU bench always crashed. The bench's
    rows for a GPU must name only paths that build there: the meta device stands in
    for CUDA (allocate refuses the direct path on every non-CPU device alike)."""
    cuda = torch.device("cuda")
    assert bench_variants.implementations(cuda) == ("reference", "mirror")
    assert {v.impl for v in bench_variants.variants(cuda)} == {"reference", "mirror"}
    assert "direct" in bench_variants.implementations(torch.device("cpu"))
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32)
    meta_device = torch.device("meta")
    for name in bench_variants.implementations(meta_device):
        bench_variants.build(name, config, meta_device)  # raised ValueError for "direct"


def test_numpy_rows_see_the_same_step_as_the_torch_rows():
    """The comparison row must differ only in the input types: same values, numpy
    arrays for every index/count/table, the hidden still a tensor."""
    step = make_steps(StepConfig(), 1, seed=3)[0]
    converted = step.as_numpy()
    for name, value in vars(step).items():
        other = getattr(converted, name)
        if isinstance(value, torch.Tensor) and name != "hidden":
            assert isinstance(other, np.ndarray) and np.array_equal(other, value.numpy())
        else:
            assert other is value


def test_bench_fails_loudly_when_results_differ(monkeypatch, capsys):
    """Corrupt the reference's token maps: the bench must exit 1 before timing."""
    original = ReferenceMTPMetadata.write_token_maps

    def corrupted(self, gpu_view, rows, positions, *args, **kwargs):
        original(self, gpu_view, rows, positions, *args, **kwargs)
        gpu_view.token_to_block_idx[0] += 1

    monkeypatch.setattr(ReferenceMTPMetadata, "write_token_maps", corrupted)
    assert bench.main(SMALL_FLAGS) == 1
    assert "RESULTS DIFFER" in capsys.readouterr().err


def test_cli_rejects_unknown_commands(capsys):
    assert cli_main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_kernel_floor_does_the_same_work_as_the_direct_path(tmp_path):
    """The floor is only a bound if it leaves the same view and buffers as the full
    direct path; the bench reports it next to the implementations."""
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    assert bench_variants.floor_matches(config, make_steps(config, 2))


def test_kernel_floor_that_skips_work_is_caught(monkeypatch, capsys):
    """A floor step that does less than the direct path (here: no TP pad rows in the
    commit pass) must fail the bench instead of reporting a bound."""
    def without_padding(meta, view, inputs, config):
        values = {f.name: getattr(inputs, f.name)
                  for f in fields(bench_variants.FloorInputs)}
        inputs = bench_variants.FloorInputs(**{**values, "padded_tokens": 0,
                                               "pad_tokens": 0})
        original(meta, view, inputs, config)

    original = bench_variants.floor_step
    monkeypatch.setattr(bench_variants, "floor_step", without_padding)
    assert bench.main(SMALL_FLAGS) == 1
    assert "kernel floor step differs" in capsys.readouterr().err


def test_cold_start_compiles_into_a_fresh_cache_then_reports_the_warm_median(
        monkeypatch, tmp_path):
    """The cold process must start from an empty numba cache of its own (it used to
    reuse whatever the bench's earlier work had cached: "cold" read as warm), write
    the compiled kernels there, and the warm runs must load them from the same place.
    A cache the caller left warm must not be used."""
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    caller_cache = tmp_path / "caller-cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(caller_cache))
    seen = []
    real_run = bench_measure.subprocess.run

    def run(*args, env=None, **kwargs):
        cache = Path(env["NUMBA_CACHE_DIR"])
        seen.append((cache, sum(1 for p in cache.rglob("*") if p.is_file())))
        return real_run(*args, env=env, **kwargs)

    monkeypatch.setattr(bench_measure.subprocess, "run", run)
    result = bench_measure.cold_start(config, warm_runs=2)
    assert len(seen) == 3
    caches = {cache for cache, _ in seen}
    assert len(caches) == 1 and caller_cache not in caches  # one fresh cache for all
    assert [files for _, files in seen][0] == 0  # the cold run starts empty
    if not numba.config.DISABLE_JIT:  # (.ci/run's coverage pass compiles nothing)
        assert all(files > 0 for _, files in seen[1:])  # the warm runs find it filled
    assert result["cache_files_written"] == seen[1][1]
    runs = result["warm_runs_s"]
    assert len(runs) == 2 and all(run > 0 for run in runs)
    assert result["warm_s"] == pytest.approx(sum(runs) / 2)  # median of two
    assert result["compile_s"] == pytest.approx(result["cold_s"] - result["warm_s"])
    assert not next(iter(caches)).exists()  # removed afterwards


def _pass_orders(monkeypatch, seed: int, repeats: int):
    """The labels ``measure`` times, pass by pass (whole steps only)."""
    timed = []
    real = bench_measure._Run.time_steps

    def record(run, device):
        timed.append(run.label)
        real(run, device)

    monkeypatch.setattr(bench_measure._Run, "time_steps", record)
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    results, floors = bench_measure.measure(config, make_steps(config, 2), repeats,
                                            torch.device("cpu"), order_seed=seed)
    rows = len(results) + len(floors)
    warm = len(floors)  # _floor_runs times each floor once to warm it
    timed = timed[warm:]
    assert len(timed) == rows * repeats
    return [timed[i:i + rows] for i in range(0, len(timed), rows)], results


def test_every_pass_times_each_row_once_in_a_seeded_varying_order(monkeypatch):
    """A row timed right after a heavy one pays its cache misses. With one fixed order
    the torch-input kernel floor always ran right after the numpy floor, on the same
    buffers, and printed faster than the numpy floor it only adds work to. Each pass
    must time every row once, no row may always follow the same neighbour, and the
    order must repeat for the same seed."""
    passes, results = _pass_orders(monkeypatch, seed=0, repeats=6)
    for order in passes:
        assert sorted(order) == sorted(passes[0])  # every row once per pass
    assert len({tuple(order) for order in passes}) > 1
    before_torch_floor = {order[order.index("kernel floor, torch inputs") - 1]
                          if order.index("kernel floor, torch inputs") else None
                          for order in passes}
    assert len(before_torch_floor) > 1, before_torch_floor
    assert all(len(row["us_by_pass"]) == 6 for row in results.values())
    again, _ = _pass_orders(monkeypatch, seed=0, repeats=6)
    assert again == passes


def test_speed_up_spread_pairs_each_pass_with_its_own_reference_pass():
    """Hand-worked: the reference's passes 100, 200, 400 µs against the direct path's
    10, 40, 20 give per-pass speed-ups 10x, 5x, 20x: 5.0x to 20.0x; the mirror path's
    200, 100, 400 give 0.5x, 2x, 1x: 2.0x slower to 2.0x."""
    from mtpmeta.bench.report import spread_line

    results = {
        "ref": {"impl": "reference", "inputs": "torch", "draft": "eager",
                "us_by_pass": [100.0, 200.0, 400.0]},
        "direct": {"impl": "direct", "inputs": "torch", "draft": "eager",
                   "us_by_pass": [10.0, 40.0, 20.0]},
        "mirror": {"impl": "mirror", "inputs": "torch", "draft": "eager",
                   "us_by_pass": [200.0, 100.0, 400.0]},
    }
    results = {bench_variants.Variant(row["impl"], row["inputs"], row["draft"]).label: row
               for row in results.values()}
    assert " ".join(spread_line(results).split()) == (
        "speed-up per pass, lowest to highest of 3: direct torch eager 5.0x to 20.0x, "
        "mirror torch eager 2.0x slower to 2.0x")


@pytest.mark.parametrize("before, after, cpus, busy", [
    (1.0, 1.2, 2, False),   # the bench's own process on an idle 2-CPU machine
    (2.1, 1.0, 2, True),    # another process held more than one of the two CPUs
    (1.0, 2.5, 2, True),
    (8.0, 8.5, 16, False),  # 7.5 others on 16 CPUs: under half
    (9.5, 9.0, 16, True),
])
def test_machine_load_flags_a_busy_machine(monkeypatch, before, after, cpus, busy):
    monkeypatch.setattr(bench_measure.os, "getloadavg", lambda: (after, 0.0, 0.0))
    monkeypatch.setattr(bench_measure.os, "cpu_count", lambda: cpus)
    load = bench_measure.machine_load(before)
    assert load == {"before": before, "after": after, "cpus": cpus, "busy": busy}
    from mtpmeta.bench.report import load_lines

    lines = load_lines(load)
    assert lines[0].startswith(f"load average (1 min) {before:.2f} before timing")
    assert (len(lines) == 2 and lines[1].startswith("WARNING: the machine is busy")) == busy
