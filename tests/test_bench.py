"""The bench command and the standard-step workload.

Failure stories: a workload that changes between runs makes asv history meaningless;
a bench that keeps timing after the implementations disagree reports speed-ups of
wrong code.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mtpmeta import bench
from mtpmeta.__main__ import main as cli_main
from mtpmeta.workload import StepConfig, make_steps

SMALL_FLAGS = ["--max-requests", "32", "--active", "16", "--block-columns", "16",
               "--block-size", "16", "--prefill-tokens", "32", "--depths", "2",
               "--steps", "2", "--repeats", "1", "--no-cold-start"]


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


def test_step_config_refuses_more_active_requests_than_slots():
    with pytest.raises(ValueError, match="max_requests"):
        StepConfig(max_requests=8, active=8)


def test_bench_cli_writes_json_with_every_implementation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", *SMALL_FLAGS, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"reference", "direct", "mirror"}
    assert results["reference"]["syncs_per_step"] == 2 + 2  # 2 depths; commit total, max
    for name in ("direct", "mirror"):
        assert results[name]["syncs_per_step"] == 0
        assert results[name]["draft_loop_allocations"] == 0
    printed = capsys.readouterr().out
    assert "views identical" in printed and "speed-up" in printed


def test_bench_fails_loudly_when_results_differ(monkeypatch, capsys):
    """Corrupt the reference's token maps: the bench must exit 1 before timing."""
    original = bench.ReferenceMTPMetadata.write_token_maps

    def corrupted(self, gpu_view, rows, positions, *args, **kwargs):
        original(self, gpu_view, rows, positions, *args, **kwargs)
        gpu_view.token_to_block_idx[0] += 1

    monkeypatch.setattr(bench.ReferenceMTPMetadata, "write_token_maps", corrupted)
    assert bench.main(SMALL_FLAGS) == 1
    assert "RESULTS DIFFER" in capsys.readouterr().err


def test_cli_rejects_unknown_commands(capsys):
    assert cli_main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_kernel_floor_does_the_same_work_as_the_direct_path(tmp_path):
    """The floor is only a bound if it leaves the same view and buffers as the full
    direct path; the bench reports it next to the implementations."""
    out = tmp_path / "bench.json"
    assert bench.main([*SMALL_FLAGS, "--json", str(out)]) == 0
    floor = json.loads(out.read_text())["kernel_floor"]
    assert floor["same_result"] is True and floor["us_per_step"] > 0


def test_kernel_floor_that_skips_work_is_caught(monkeypatch, capsys):
    """A floor step that does less than the direct path (here: no TP pad rows in the
    commit pass) must fail the bench instead of reporting a bound."""
    from mtpmeta import floor

    def without_padding(meta, view, inputs, config):
        inputs = floor.FloorInputs(**{**vars(inputs), "padded_tokens": 0,
                                      "pad_tokens": 0})
        original(meta, view, inputs, config)

    original = floor.floor_step
    monkeypatch.setattr(floor, "floor_step", without_padding)
    assert bench.main(SMALL_FLAGS) == 1
    assert "kernel floor step differs" in capsys.readouterr().err


def test_cold_start_runs_new_processes_and_reports_the_warm_median():
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    result = bench.cold_start(config, warm_runs=2)
    runs = result["warm_cache_runs_s"]
    assert len(runs) == 2 and all(run > 0 for run in runs)
    assert result["warm_cache_s"] == pytest.approx(sum(runs) / 2)  # median of two
    assert result["first_run_s"] > 0
