"""The bench's captured row (contract §12): what the host pays for a captured draft loop.

With ``capture_setup=True`` the per-depth setup lives in the CUDA graph the caller
captured once per padded size, so the host's whole draft loop is one ``begin_decode``
and the graph replays. This module times exactly that host work (``begin_decode(...,
capture_setup=True)`` + ``end_forward``; the replays themselves are excluded, they are
device work the caller launches) against the default graphed draft loop (eager setup
before every replay) of the same standard step, on each path, and counts the torch ops
the library issues for it. It also counts the ops one captured depth puts in the graph
(its setup and advance), which each replay then re-runs on the device.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from mtpmeta.mirror.captured_route import ADVANCE_OPS, DEPTH_OPS
from mtpmeta.bench.opcount import OpCounter
from mtpmeta.bench.variants import build, implementations
from mtpmeta.bench.workload import StepConfig, StepInputs, run_draft

__all__ = ["measure_captured", "format_captured"]


def _captured_host_loop(meta: Any, inputs: StepInputs, config: StepConfig) -> None:
    """A captured step's host side of the draft loop (no replay)."""
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, True, capture_setup=True)
    meta.end_forward()


def _us_per_step(run, steps: List[StepInputs], repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for inputs in steps:
            run(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter_ns() - start) / len(steps) / 1e3)
    return best


def measure_captured(config: StepConfig, steps: List[StepInputs], repeats: int,
                     device: torch.device) -> Dict[str, Dict[str, Any]]:
    """Per library path: host µs per step (best of ``repeats``) and data ops per step
    of the captured loop's host work and of the default graphed loop, and the op
    count of one captured depth (setup, advance) as recorded into a graph."""
    graphed = StepConfig(**{**config.__dict__, "graphed": True})
    out: Dict[str, Dict[str, Any]] = {}
    for name in implementations(device):
        if name == "reference":
            continue
        meta, view = build(name, graphed, device)
        meta.begin_decode_for_capture(graphed.padded_active, capture_setup=True)
        with OpCounter() as depth:
            meta.setup_decode_step(view)
        with OpCounter() as advance:
            meta.advance_decode_step()
        meta.end_forward()
        run_draft(meta, view, steps[0], graphed)  # warm both routes' plans
        _captured_host_loop(meta, steps[0], graphed)
        with OpCounter() as host_ops:
            _captured_host_loop(meta, steps[0], graphed)
        with OpCounter() as default_ops:
            run_draft(meta, view, steps[0], graphed)
        out[name] = {
            "captured_host_us_per_step": _us_per_step(
                lambda s: _captured_host_loop(meta, s, graphed), steps, repeats, device),
            "default_graphed_us_per_step": _us_per_step(
                lambda s: run_draft(meta, view, s, graphed), steps, repeats, device),
            "captured_host_data_ops": host_ops.data_ops,
            "captured_host_syncs": host_ops.scalar_reads,
            "captured_host_allocations": host_ops.new_storages,
            "default_graphed_data_ops": default_ops.data_ops,
            "graph_ops_per_depth": depth.data_ops + advance.data_ops,
            "graph_ops_setup": depth.data_ops, "graph_ops_advance": advance.data_ops,
        }
        if (depth.data_ops, advance.data_ops) != (DEPTH_OPS, ADVANCE_OPS):
            raise RuntimeError(f"captured depth issued {depth.data_ops} + "
                               f"{advance.data_ops} ops; mtpmeta.mirror.captured_route documents "
                               f"{DEPTH_OPS} + {ADVANCE_OPS}")
    return out


def format_captured(result: Dict[str, Dict[str, Any]], depths: int) -> str:
    """The captured rows, one per path, with what they exclude."""
    lines = [f"captured draft loop (capture_setup=True), host side of a {depths}-depth "
             "loop; the graph replays are excluded (device work the caller launches):"]
    for name, row in result.items():
        lines.append(
            f"  {name:<8} {row['captured_host_us_per_step']:>8.1f} µs/step, "
            f"{row['captured_host_data_ops']} data ops, {row['captured_host_syncs']} syncs, "
            f"{row['captured_host_allocations']} allocs   (default graphed loop: "
            f"{row['default_graphed_us_per_step']:.1f} µs, "
            f"{row['default_graphed_data_ops']} data ops)   in the graph per depth: "
            f"{row['graph_ops_setup']} setup + {row['graph_ops_advance']} advance ops")
    return "\n".join(lines)
