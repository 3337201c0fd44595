"""Data ops per call of the standard step: mtpmeta's mirror path beside the reference.

The reference issues upstream's op sequence (``mtpmeta/reference.py``; its counts are
asserted against upstream's measured ones in ``tests/test_op_budget.py``), so its column
is the upstream-equivalent count. On a GPU each data op is a launch, 4-7 µs of host time.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["CALLS", "counted_step", "ops_per_call", "format_ops_per_call"]

CALLS = ("rows", "carry", "begin_decode", "depth", "advance", "commit")


def counted_step(meta: Any, view: Any, inputs: Any, config: Any,
                 commit_inputs: Any = None) -> Dict[str, List[Any]]:
    """One standard step with an ``OpCounter`` per call: ``{call: [counters]}`` (one
    counter per depth and per advance). ``commit_inputs``: the commit pass's step inputs
    when they differ from the draft loop's (device draft inputs, host commit inputs)."""
    from mtpmeta.bench.opcount import OpCounter
    from mtpmeta.bench.workload import run_rows

    calls: Dict[str, List[Any]] = {name: [] for name in CALLS}

    def counted(name, fn, *args, **kwargs):
        with OpCounter() as counter:
            fn(*args, **kwargs)
        calls[name].append(counter)

    counted("rows", run_rows, meta, inputs)
    counted("carry", meta.carry_chunk_boundary, inputs.hidden, inputs.carry_req_id,
            inputs.carry_position)
    meta.take_chunk_boundary(inputs.carry_req_id, inputs.carry_position)
    counted("begin_decode", meta.begin_decode, config.active, config.padded_active,
            inputs.start_positions, inputs.block_table, config.graphed)
    for _ in range(config.depths):
        counted("depth", meta.setup_decode_step, view)
        counted("advance", meta.advance_decode_step)
    meta.end_forward()
    commit = inputs if commit_inputs is None else commit_inputs
    counted("commit", meta.setup_commit_pass, view, commit.append_counts,
            commit.block_table, start_positions=commit.commit_starts,
            inherited_blocks=commit.inherited, padded_token_count=commit.padded_tokens,
            padded_request_count=commit.padded_requests)
    meta.end_forward()
    return calls


def _count(meta: Any, view: Any, inputs: Any, config: Any) -> Dict[str, int]:
    """Data ops per call of one standard step (per depth and per advance: one of each)."""
    calls = counted_step(meta, view, inputs, config)
    return {name: sum(c.data_ops for c in counters) // max(len(counters), 1)
            for name, counters in calls.items()}


def ops_per_call(config: Any) -> Dict[str, Dict[str, int]]:
    """``{path: {call: data ops}}`` (per depth and per advance: one of each) on warm
    objects, for the reference and the mirror path (CPU-forced)."""
    from mtpmeta.bench.variants import build
    from mtpmeta.bench.workload import make_steps, run_step

    steps = make_steps(config, 3, seed=0)
    out = {}
    for path in ("reference", "mirror"):
        meta, view = build(path, config, torch.device("cpu"))
        for inputs in steps[:2]:
            run_step(meta, view, inputs, config)
        out[path] = _count(meta, view, steps[2], config)
        out[path]["step"] = (sum(out[path][c] for c in CALLS if c not in ("depth", "advance"))
                             + config.depths * (out[path]["depth"] + out[path]["advance"]))
    return out


def format_ops_per_call(result: Dict[str, Dict[str, int]]) -> str:
    names = CALLS + ("step",)
    lines = ["device data ops per call, standard step (reference = upstream's op sequence)",
             "  " + f"{'':<28}" + "".join(f"{n:>13}" for n in names)]
    labels = {"reference": "reference (upstream-equiv.)", "mirror": "mtpmeta mirror"}
    for path, row in result.items():
        lines.append("  " + f"{labels[path]:<28}" + "".join(f"{row[n]:>13}" for n in names))
    return "\n".join(lines)
