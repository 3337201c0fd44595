"""The bench's device-traffic counts: host-to-device bytes of the mirror path against
upstream's flow, and the production-size step they are counted on. Counts and shapes
only; no timing is asserted."""

from __future__ import annotations

import numpy as np
import torch

from mtpmeta.bench.counters import H2DCounter, measure_traffic, \
    recorded_mirror, upstream_h2d_bytes
from mtpmeta.bench.workload import StepConfig, make_steps, production_steps


def test_h2d_counter_sees_begin_decode_ship_the_table_once():
    """Hand-worked: begin_decode of n rows moves, in one host-to-device copy, the head
    region (the int32 device count and R int32 offsets: 17 words, padded to 72 bytes)
    and the [n, W] int32 table rows rounded up to BEGIN_ROWS (10 -> 16), and a draft
    depth moves no table at all."""
    config = StepConfig(max_requests=16, block_columns=32, block_size=8, active=10,
                        prefill_tokens=8, inherited_blocks=1, moves=2, swaps=1, resets=2)
    meta, view, recorder = recorded_mirror(config)
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


def test_traffic_counts_bytes_and_ops_of_the_mirror_path_and_the_reference():
    """At a small size: the mirror path moves the draft table once (begin_decode) and,
    of the commit's table, only the row the draft loop's device table does not hold
    (the prefill row), so its bytes per step are under upstream's flow (both tables);
    its data ops per step are the 14 of the op budget."""
    config = StepConfig(max_requests=24, block_columns=256, block_size=16, active=16,
                        prefill_tokens=16, inherited_blocks=1, moves=2, swaps=1,
                        resets=2)
    result = measure_traffic(config, steps=1)
    h2d = result["h2d_bytes_per_step"]
    tables = 16 * 256 * 4 + 1 * 256 * 4  # begin's [n, W]; the commit's row n
    assert tables < h2d["mirror"] < tables + 16 * 1024
    assert h2d["mirror"] < h2d["upstream flow"]
    # Commit first: it follows the previous step's draft loop on another table.
    both = 16 * 256 * 4 + 17 * 256 * 4
    assert both < h2d["mirror, commit first"] < both + 16 * 1024
    assert result["ops_per_step"]["mirror"] == {"data_ops": 14, "syncs": 0}
    assert result["ops_per_step"]["reference"]["syncs"] == 5
