"""The bench sections of issue 17: fresh shapes, H2D byte counts, the width sweep's
byte column and upstream's flow. Counts and shapes only; no timing is asserted."""

from __future__ import annotations

import numpy as np
import torch

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.fresh_shapes import fresh_steps
from mtpmeta.bench.h2d import H2DCounter, StagingRecorder
from mtpmeta.bench.production import production_steps, upstream_h2d_bytes
from mtpmeta.bench.workload import StepConfig, make_steps
from mtpmeta.buffers.device_runtime import use_runtime


def test_fresh_steps_never_repeat_a_shape():
    """A memoized plan must never be the reason the fresh-shapes row is fast: no two
    steps share an active count, a padded count, a commit size (requests) or a prefill
    chunk size."""
    config = StepConfig()
    steps = fresh_steps(config, 20, seed=3)
    actives = [c.active for c, _ in steps]
    padded = [c.padded_active for c, _ in steps]
    commit_requests = [s.append_counts.numel() for _, s in steps]
    prefills = [int(s.append_counts[-1]) for _, s in steps]
    for values in (actives, padded, commit_requests, prefills):
        assert len(set(values)) == len(values), values
    for step_config, inputs in steps:
        assert inputs.start_positions.numel() == step_config.active


def _mirror(config: StepConfig):
    recorder = StagingRecorder()
    with use_runtime(recorder):
        meta = MTPMetadata(**config.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=config.max_tokens)
    view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
    return meta, view, recorder


def test_h2d_counter_sees_begin_decode_ship_the_table_once():
    """Hand-worked: begin_decode of n rows moves, in one host-to-device copy, the head
    region (the int32 device count and R int32 offsets: 17 words, padded to 72 bytes)
    and the [n, W] int32 table rows rounded up to BEGIN_ROWS (10 -> 16), and a draft
    depth moves no table at all."""
    config = StepConfig(max_requests=16, block_columns=32, block_size=8, active=10,
                        prefill_tokens=8, inherited_blocks=1, moves=2, swaps=1, resets=2)
    meta, view, recorder = _mirror(config)
    inputs = make_steps(config, 1, seed=0)[0]
    with H2DCounter(recorder) as counter:
        meta.begin_decode(10, 16, inputs.start_positions, inputs.block_table, False)
    assert (counter.copies, counter.nbytes) == (1, 72 + 16 * 32 * 4)
    with H2DCounter(recorder) as counter:
        meta.setup_decode_step(view)
    assert counter.copies == 1
    assert counter.nbytes < 32 * 4 * 10  # less than the table's n rows: O(padded)


def test_upstream_flow_bytes_follow_the_formula():
    """Upstream's flow per step: [n, W] table + [n] starts, [P, W] table + 3 x [P] inputs
    and the hidden, all int32 / float32 here."""
    config = StepConfig(max_requests=16, block_columns=32, block_size=8, active=10,
                        prefill_tokens=8, inherited_blocks=1, moves=2, swaps=1, resets=2,
                        hidden_size=6)
    steps = make_steps(config, 2, seed=1)
    P = 11  # active + the prefill request
    want = 10 * 32 * 4 + 10 * 4 + P * 32 * 4 + 3 * P * 4 + 6 * 4
    assert upstream_h2d_bytes(config, steps) == want


def test_production_positions_spread_like_context_lengths():
    """Log-normal starts: most far below the table's capacity, none past it, and the
    commit starts stay consistent with them (start - count, floored at 0)."""
    config = StepConfig(max_requests=64, block_columns=2048, block_size=64, active=48,
                        prefill_tokens=64, inherited_blocks=2, moves=4, swaps=2, resets=4)
    step = production_steps(config, 1, seed=0)[0]
    starts = step.start_positions.numpy()
    capacity = 2048 * 64
    assert starts.max() < capacity and starts.min() >= 0
    assert np.median(starts) < capacity / 10
    counts = step.append_counts.numpy()[:48]
    assert np.array_equal(step.commit_starts.numpy()[:48],
                          np.maximum(starts - counts, 0))
    assert step.start_positions.dtype == torch.int32


def test_width_sweep_reports_the_mirror_bytes_flat_over_widths():
    """The sweep's byte column: the mirror path's per-depth H2D payload is the same at
    every width (no table through the host per depth); the direct path's instructions
    or µs are reported for every width. Wall clock here (no callgrind in the test)."""
    from mtpmeta.bench.sweep_width import format_width_sweep, width_sweep

    spread = {}
    result = width_sweep((16, 128), active=8, repeats=2, instructions=False,
                         spread=spread)
    assert result["h2d_bytes_per_depth"][16] == result["h2d_bytes_per_depth"][128] > 0
    assert set(result["per_depth"]) == {"mirror", "direct", "reference"}
    assert all(set(row) == {16, 128} for row in result["per_depth"].values())
    assert "W 128 / W 16" in format_width_sweep(result)
    assert "(target <= 1.2x; the target is for instruction counts (--instructions)" in \
        format_width_sweep(result)
    # The plot's bars: each cell's lowest and highest of the 2 passes around its median.
    assert set(spread) == set(result["per_depth"])
    for path, row in result["per_depth"].items():
        for width, median in row.items():
            low, high = spread[path][width]
            assert low <= median <= high
    assert "spread" not in result  # the JSON keeps its keys


def test_batch_sweep_fills_the_per_pass_spread():
    from mtpmeta.bench.measure import sweep

    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    spread = {}
    result = sweep(config, [4, 8], 2, torch.device("cpu"), 1, spread=spread)
    assert set(spread) == set(result) == {"reference", "direct", "mirror"}
    for name, row in result.items():
        assert set(spread[name]) == {4, 8}
        for active, median in row.items():
            low, high = spread[name][active]
            assert low <= median <= high


def test_fresh_shapes_explain_a_path_slower_than_the_reference():
    from mtpmeta.bench.fresh_shapes import format_fresh_shapes

    result = {"count": 4, "fresh_us_per_step": {"reference": 100.0, "direct": 20.0,
                                                "mirror": 128.0},
              "repeated_us_per_step": {"reference": 90.0, "direct": 5.0, "mirror": 40.0}}
    text = " ".join(format_fresh_shapes(result).split())
    assert "reference/path fresh 0.78x" in text
    assert ("reference/path below 1x (mirror): slower than the reference when no shape "
            "repeats, because each new shape builds that path's plans") in text
    result["fresh_us_per_step"]["mirror"] = 60.0
    assert "below 1x" not in format_fresh_shapes(result)
    assert "first use" not in format_fresh_shapes(result)
    result["first_use_ms"] = {"reference": 1.5, "direct": 2.25, "mirror": 40.0}
    text = " ".join(format_fresh_shapes(result).split())
    assert ("first use of a new object (build, allocate, one step), ms: reference 1.5, "
            "direct 2.2, mirror 40.0 (the mirror path builds its views") in text


def test_production_section_counts_bytes_and_ops_of_every_row():
    """At a small size: the mirror path moves the draft table once (begin_decode) and,
    of the commit's table, only the row the draft loop's device table does not hold
    (the prefill row), so its bytes per step are under upstream's flow (both tables);
    its data ops per step are the 14 of the op budget."""
    from mtpmeta.bench.production import format_production, measure_production

    config = StepConfig(max_requests=24, block_columns=256, block_size=16, active=16,
                        prefill_tokens=16, inherited_blocks=1, moves=2, swaps=1,
                        resets=2)
    result = measure_production(config, steps=1, repeats=1)
    h2d = result["h2d_bytes_per_step"]
    tables = 16 * 256 * 4 + 1 * 256 * 4  # begin's [n, W]; the commit's row n
    assert tables < h2d["mirror"] < tables + 16 * 1024
    assert h2d["mirror"] < h2d["upstream flow"]
    # Commit first: it follows the previous step's draft loop on another table.
    both = 16 * 256 * 4 + 17 * 256 * 4
    assert both < h2d["mirror, commit first"] < both + 16 * 1024
    assert result["ops_per_step"]["mirror (CPU-forced)"] == {"data_ops": 14, "syncs": 0}
    assert result["ops_per_step"]["reference"]["syncs"] == 5
    assert "host-to-device bytes per step" in format_production(result)
