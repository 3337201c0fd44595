"""The callgrind instruction counter behind ``mtpmeta bench --instructions`` and the asv
``track_`` benchmarks, wired up end to end on a tiny program (no torch import, a few
seconds); the standard-step measurement itself takes minutes and is not run here.

Failure stories: the client requests do not reach callgrind (instrumentation never
starts, every region counts 0 or the whole process), regions are dumped under the
wrong label, or the parser reads another file's totals.
"""

from __future__ import annotations

import pytest

from mtpmeta.bench import instructions
from mtpmeta.bench.workload import StepConfig

_TINY = """
def work(n):
    total = 0
    for i in range(n):
        total += i * i
    return total

work(50)
region("small", lambda: work(2000))
region("large", lambda: work(20000))
region("small again", lambda: work(2000))
"""


@pytest.mark.skipif(instructions.unavailable() is not None,
                    reason=str(instructions.unavailable()))
def test_callgrind_regions_count_only_the_marked_work():
    """Ten times the loop is about ten times the instructions, and the same work
    counts the same twice: the count is of the region, not of the process."""
    counts = instructions.callgrind_regions(_TINY, timeout=300)
    assert list(counts) == ["small", "large", "small again"]
    assert counts["small"] > 0
    assert 8 <= counts["large"] / counts["small"] <= 12, counts
    assert abs(counts["small again"] - counts["small"]) <= 0.02 * counts["small"], counts


def test_step_regions_measure_every_variant_and_call():
    """The child side of the standard-step measurement, with a plain runner in place of
    callgrind's marker: every region the ratios are computed from is there and runs."""
    config = StepConfig(max_requests=32, active=16, block_columns=16, block_size=16,
                        prefill_tokens=32, depths=2)
    ran = []
    instructions.step_regions(lambda label, run: (run(), ran.append(label)),
                              vars(config), steps=1, seed=0)
    for draft in ("eager", "graphed"):
        for variant in ("reference torch", "direct torch", "direct numpy", "mirror torch"):
            assert f"{variant} {draft}" in ran
    assert {"kernel floor", "kernel floor, torch inputs"} <= set(ran)


def test_instruction_counts_are_refused_clearly_without_valgrind(monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    assert instructions.unavailable().startswith("valgrind is not installed")
    with pytest.raises(RuntimeError, match="valgrind is not installed"):
        instructions.callgrind_regions("pass")


def test_step_counts_become_per_step_ratios(monkeypatch):
    """The ratios the bench prints and asv tracks are per step, from the labels
    step_regions dumps (here fed to the arithmetic directly)."""
    counts = {}
    for draft in ("eager", "graphed"):
        counts[f"reference torch {draft}"] = 4000
        counts[f"direct torch {draft}"] = 500
        counts[f"direct numpy {draft}"] = 400
        counts[f"mirror torch {draft}"] = 1000
    counts["kernel floor"] = 250
    counts["kernel floor, torch inputs"] = 400
    monkeypatch.setattr(instructions, "callgrind_regions", lambda body, timeout: counts)
    result = instructions.count_step_instructions(StepConfig(), steps=2)
    assert result["per_step"]["direct torch eager"] == 250
    assert result["reference_over_direct_eager"] == 8
    assert result["direct_over_floor_graphed"] == 2
    assert result["direct_over_torch_floor_eager"] == 1.25
    text = instructions.format_instructions(result)
    assert "8.0x fewer than the reference" in text and "2.00x" in text
