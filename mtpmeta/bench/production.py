"""``mtpmeta bench --geometry production``: one step at a production-like size.

R 1024, N 768 active, W 2048 columns of 64 tokens, K 3 draft depths, and start
positions drawn from a log-normal spread of context lengths (median 3000 tokens, most
under 16k, clipped to the table), not uniform over the whole capacity: a realistic
engine's requests use a few percent of the table's columns, and a cost that follows
the capacity rather than the work shows up here. Reported per step, in one run: µs of
the reference (upstream's op sequence), the direct path and the mirror path
(CPU-forced, where the device copies run on the host; and on torch's ``meta`` device,
where every op is dispatched but moves no data: the host's share on a GPU), the host-to-device bytes of the mirror
path (counted; in the standard step order, where the commit pass follows the draft loop
on one table and takes the rows the device already holds, and with the commit pass
first, where it cannot) beside upstream's flow (one ``[n, W]`` table per draft loop,
the commit's ``[P, W]`` and the small inputs: the formula of ``upstream_h2d_bytes``),
and the data ops per step of each (the reference's count is upstream's equivalent).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Dict, List

import numpy as np
import torch

__all__ = ["PRODUCTION", "production_steps", "upstream_h2d_bytes", "measure_production",
           "format_production"]


def _production_config():
    from mtpmeta.bench.workload import StepConfig

    return StepConfig(max_requests=1024, block_columns=2048, block_size=64, active=768,
                      depths=3, prefill_tokens=256, inherited_blocks=8, tp=8)


PRODUCTION = _production_config()


def production_steps(config=PRODUCTION, steps: int = 4, seed: int = 0) -> List[Any]:
    """``make_steps`` with start positions from a log-normal spread of context lengths
    (median 3000 tokens, sigma 1) instead of uniform over the table's capacity."""
    from mtpmeta.bench.workload import make_steps

    rng = np.random.default_rng(seed + 1)
    limit = config.block_columns * config.block_size - config.depths - 4
    n = config.active
    out = []
    for step in make_steps(config, steps, seed=seed):
        starts = np.zeros(config.max_requests, dtype=np.int32)
        starts[:n] = np.clip(rng.lognormal(np.log(3000.0), 1.0, n), 0, limit)
        counts = step.append_counts.numpy()
        commit = step.commit_starts.numpy().copy()
        commit[:n] = np.maximum(starts[:n] - counts[:n], 0)
        commit_full = np.zeros(config.max_requests, dtype=np.int32)
        commit_full[:n + 1] = commit
        out.append(replace(step, start_positions=torch.from_numpy(starts)[:n],
                           commit_starts=torch.from_numpy(commit_full)[:n + 1]))
    return out


def upstream_h2d_bytes(config, steps: List[Any]) -> float:
    """Host-to-device bytes per step of upstream's flow from host inputs: begin_decode's
    ``[n, W]`` table and ``[n]`` starts, the commit pass's ``[P, W]`` table and its three
    ``[P]`` inputs (counts, starts, inherited), and the carried hidden."""
    n, W = config.active, config.block_columns
    table_item = torch.empty((), dtype=config.metadata_kwargs()["block_table_dtype"]).element_size()
    total = 0
    for step in steps:
        P = step.append_counts.numel()
        total += n * W * table_item + n * 4 + P * W * 4 + 3 * P * 4
        total += step.hidden.numel() * step.hidden.element_size()
    return total / len(steps)


def _build(name: str, config, device: str):
    from mtpmeta.gpu_view import ContextGPUView
    from mtpmeta.metadata import MTPMetadata
    from mtpmeta.buffers.device_runtime import use_runtime
    from mtpmeta.bench.h2d import StagingRecorder
    from mtpmeta.bench.variants import build

    if name == "reference":
        return build("reference", config, torch.device("cpu")) + (None,)
    recorder = StagingRecorder()
    with use_runtime(recorder):
        meta = MTPMetadata(**config.metadata_kwargs())
        meta.allocate(device, mirror=name != "direct", max_tokens=config.max_tokens)
    view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns,
                          device)
    return meta, view, recorder


def measure_production(config=PRODUCTION, *, steps: int = 4, repeats: int = 7,
                       seed: int = 0) -> Dict[str, Any]:
    """µs per step (median of ``repeats`` interleaved passes), H2D bytes and data ops per
    step, for each row (see the module docstring)."""
    from mtpmeta.bench.h2d import H2DCounter
    from mtpmeta.bench.opcount import OpCounter
    from mtpmeta.bench.workload import run_step, run_step_commit_first

    torch.set_num_threads(1)
    inputs = production_steps(config, steps, seed)
    rows = {"reference": "reference", "direct": "direct",
            "mirror (CPU-forced)": "mirror", "mirror host work": "mirror"}
    built = {label: _build(name, config, "meta" if label == "mirror host work" else "cpu")
             for label, name in rows.items()}
    runners = {label: (lambda x, meta=built[label][0], view=built[label][1]:
                       run_step(meta, view, x, config)) for label in rows}
    for run in runners.values():  # warm: JIT, per-shape plans
        for x in inputs:
            run(x)
    samples: Dict[str, List[float]] = {label: [] for label in rows}
    for _ in range(repeats):
        for label, run in runners.items():
            start = time.perf_counter_ns()
            for x in inputs:
                run(x)
            samples[label].append((time.perf_counter_ns() - start) / len(inputs) / 1e3)
    result: Dict[str, Any] = {"config": {"R": config.max_requests, "N": config.active,
                                         "W": config.block_columns, "K": config.depths,
                                         "BS": config.block_size},
                              "us_per_step": {k: statistics.median(v)
                                              for k, v in samples.items()}}
    meta, view, recorder = built["mirror (CPU-forced)"]
    with H2DCounter(recorder) as counter:
        for x in inputs:
            run_step(meta, view, x, config)
    # A fresh object, so the first commit pass follows no draft loop on its table either.
    meta, view, recorder = _build("mirror", config, "cpu")
    with H2DCounter(recorder) as commit_first:
        for x in inputs:
            run_step_commit_first(meta, view, x, config)
    result["h2d_bytes_per_step"] = {"mirror": counter.nbytes / len(inputs),
                                    "mirror, commit first": commit_first.nbytes / len(inputs),
                                    "upstream flow": upstream_h2d_bytes(config, inputs)}
    ops = {}
    for label in ("reference", "direct", "mirror (CPU-forced)"):
        meta, view, _ = built[label]
        with OpCounter() as op_counter:
            run_step(meta, view, inputs[0], config)
        ops[label] = {"data_ops": op_counter.data_ops, "syncs": op_counter.scalar_reads}
    result["ops_per_step"] = ops
    return result


def format_production(result: Dict[str, Any]) -> str:
    c = result["config"]
    us = result["us_per_step"]
    reference = us["reference"]
    lines = [f"production geometry (R {c['R']}, N {c['N']}, W {c['W']}, K {c['K']}, "
             f"BS {c['BS']}, log-normal context lengths), per step:"]
    for label, value in us.items():
        ops = result["ops_per_step"].get(label)
        extra = (f"{ops['data_ops']:>5} data ops, {ops['syncs']} syncs" if ops else
                 "(meta device: the host's share on a GPU)")
        lines.append(f"  {label:<22}{value:>10,.0f} µs {reference / value:>6.2f}x the "
                     f"reference's speed  {extra}")
    h2d = result["h2d_bytes_per_step"]
    upstream = h2d["upstream flow"]
    lines.append(f"  host-to-device bytes per step: mirror {h2d['mirror'] / 1e6:.2f} MB "
                 f"({h2d['mirror'] / upstream:.3f}x upstream's flow, "
                 f"{upstream / 1e6:.2f} MB); with the commit pass before the draft loop "
                 f"(its rows not on the device) {h2d['mirror, commit first'] / 1e6:.2f} MB "
                 f"({h2d['mirror, commit first'] / upstream:.3f}x)")
    return "\n".join(lines)
