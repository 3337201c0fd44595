"""On the default route a standard step runs no separate block-id scan
kernel: the draft depth's and the commit pass's written-block checks are part of their
staging kernels (``native.staging.decode_step_maps`` / ``commit_pass``), which refuse
before their first write (the refusals themselves: tests/test_bad_input.py,
tests/test_user_mistakes.py)."""

from __future__ import annotations

import pytest
import torch

import mtpmeta.validation.checks as checks
import mtpmeta.validation.inputs as inputs
import mtpmeta.validation.writer_inputs as writer_checks
from mtpmeta.bench.variants import build
from mtpmeta.bench.workload import StepConfig, make_steps, run_commit, run_step


def _scan_called(*args):
    raise AssertionError("a separate block-scan kernel ran on the default route")


@pytest.mark.parametrize("impl", ["direct", "mirror"])
def test_a_standard_step_runs_no_separate_block_scan(monkeypatch, impl):
    config = StepConfig(max_requests=16, block_columns=16, block_size=16, active=8,
                        prefill_tokens=32, moves=2, swaps=1, resets=2)
    meta, view = build(impl, config, torch.device("cpu"))
    monkeypatch.setattr(checks, "_first_bad_draft_block", _scan_called)
    monkeypatch.setattr(writer_checks, "_first_bad_token_block", _scan_called)
    monkeypatch.setattr(checks, "_first_bad_commit_block", _scan_called, raising=False)
    for inputs in make_steps(config, 2, seed=0):
        run_step(meta, view, inputs, config)


@pytest.mark.parametrize("impl", ["direct", "mirror"])
def test_the_commit_pass_scans_its_counts_in_its_input_kernel(monkeypatch, impl):
    """The count range check (``[0, 2**31)``) is part of
    ``native.checks.check_commit_inputs``: a commit pass runs no separate count scan
    (one numba dispatch less), and still refuses a bad count by name."""
    config = StepConfig(max_requests=16, block_columns=16, block_size=16, active=8,
                        prefill_tokens=32, moves=2, swaps=1, resets=2)
    meta, view = build(impl, config, torch.device("cpu"))
    monkeypatch.setattr(inputs, "_first_outside", _scan_called)
    step = make_steps(config, 1, seed=0)[0]
    run_commit(meta, view, step)
    table = step.block_table
    for counts, message in (([2, -1], "negative count -1 at index 1"),
                            ([2, 2**31], "count beyond int32 2147483648 at index 1")):
        with pytest.raises(ValueError, match=f"append_counts: {message}"):
            meta.setup_commit_pass(view, counts, table)
