"""``mtpmeta bench --trace``: µs per step of every path over a seeded trace.

For each geometry (standard: R 256, W 128; production: R 1024, W 2048, K 3) the trace
(``mtpmeta.bench.trace``) is replayed through the reference (upstream's op sequence),
the direct path (CPU only), the mirror path and the captured draft loop (the mirror
path with ``begin_decode(..., capture_setup=True)``: its host side), on torch's
``meta`` device with the C++ meta kernels (``mtpmeta.bench.meta_device``: the host's
share on a GPU) and CPU-forced, all in interleaved passes of one run. Per row: the
median and p90 over steps of each step's median over passes, the ratio against the
reference on the same device, device data ops, syncs and CUDA event/stream calls per
step (``CountingRuntime``), and the launch-cost estimate "meta µs + 4 µs per device
data op". The reference's read-backs on meta are answered from the host
(``HostKnownReference``): ``syncs`` counts them, upstream's syncs per step. On the
standard trace it also times the device-input route (the draft loop's start positions
and table already meta tensors) through the fused calls, and "the drop-in": upstream's
helper sequence calling mtpmeta's individual writers with device inputs. On the
production trace it also times the mirror path and the captured loop with the opt-in
table threads (``THREADED_ROWS``: two of numba's threads).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from mtpmeta.buffers.device_runtime import use_runtime
from mtpmeta.bench.meta_device import cpp_meta_kernels, meta_setup_report, micro_us
from mtpmeta.bench.trace import PRODUCTION_TRACE, PRODUCTION_WIDE_TRACE, STANDARD_TRACE, TraceConfig, \
    TraceStep, make_trace, trace_shape_stats
from mtpmeta.bench.trace_replay import CountingRuntime, DeviceOpCounter, Replay, device_inputs, \
    known_syncs

__all__ = ["LAUNCH_US", "ROWS", "THREADED_ROWS", "measure_trace", "format_trace",
           "trace_geometries", "run_trace"]

LAUNCH_US = 4.0  # the CUDA driver's launch cost per device data op, for the estimate
#: (label, path, device, device inputs, block counts, table threads). ``THREADED_ROWS``
#: time the opt-in table threads (``mtpmeta.kernels.table_threads``) on the production trace
#: only (the standard trace's table passes are small and take no derived scan).
ROWS = (("reference", "reference", "meta", False, False, 1),
        ("mirror", "mirror", "meta", False, False, 1),
        ("captured", "captured", "meta", False, False, 1),
        ("mirror, block counts", "mirror", "meta", False, True, 1),
        ("captured, block counts", "captured", "meta", False, True, 1),
        ("reference", "reference", "cpu", False, False, 1),
        ("direct", "direct", "cpu", False, False, 1),
        ("mirror", "mirror", "cpu", False, False, 1),
        ("captured", "captured", "cpu", False, False, 1))
THREADED_ROWS = (("mirror, 2 threads", "mirror", "meta", False, False, 2),
                 ("captured, 2 threads", "captured", "meta", False, False, 2),
                 ("mirror, counts, 2 threads", "mirror", "meta", False, True, 2))
DEVICE_ROWS = (("reference, device inputs", "reference", "meta", True, False, 1),
               ("mirror, device inputs", "mirror", "meta", True, False, 1),
               ("drop-in, device inputs", "drop-in", "meta", True, False, 1))
#: The production trace at W 8192 (issue 24 item 4: host cost that follows the blocks
#: in use): meta rows only.
WIDE_ROWS = ROWS[:4]


def trace_geometries(quick: bool) -> Dict[str, tuple]:
    """``{name: (TraceConfig, steps)}``: full length, or short with ``quick``."""
    return {"standard": (STANDARD_TRACE, 40 if quick else STANDARD_TRACE.steps),
            "production": (PRODUCTION_TRACE, 12 if quick else PRODUCTION_TRACE.steps),
            "production W 8192": (PRODUCTION_WIDE_TRACE,
                                  6 if quick else PRODUCTION_WIDE_TRACE.steps)}


def _percentile(values: List[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _timed_pass(replay: Replay, trace: List[TraceStep]) -> List[float]:
    replay.reset()
    out = []
    gc.collect()
    gc.disable()
    try:
        for index, step in enumerate(trace):
            replay.prepare(index, step)
            start = time.perf_counter_ns()
            replay.run(step)
            out.append((time.perf_counter_ns() - start) / 1e3)
    finally:
        gc.enable()
    return out


def _counts(replay: Replay, trace: List[TraceStep]) -> Dict[str, Any]:
    """Ops per step of the step's calls (``run``), not of ``prepare``: the untimed
    table update is 3 device ops on a step that grows a device table."""
    patched = getattr(replay.meta, "patched", 0)
    data_ops = device_data_ops = scalar_reads = 0
    overloads: set = set()
    replay.reset()
    for index, step in enumerate(trace):
        replay.prepare(index, step)
        with DeviceOpCounter() as counter:
            replay.run(step)
        data_ops += counter.data_ops
        device_data_ops += counter.device_data_ops
        scalar_reads += counter.scalar_reads
        overloads |= counter.overloads
    steps = len(trace)
    syncs = scalar_reads + getattr(replay.meta, "patched", 0) - patched
    return {"data_ops": data_ops / steps, "device_data_ops": device_data_ops / steps,
            "syncs": syncs / steps, "overloads": overloads}


def _runtime_calls(path: str, config: TraceConfig, trace: List[TraceStep],
                   device: str, on_device: bool, known: Optional[List[List[int]]],
                   counts: bool = False) -> Optional[Dict[str, float]]:
    if path not in ("mirror", "captured", "drop-in") or device == "cpu":
        return None
    runtime = CountingRuntime()
    with use_runtime(runtime):
        replay = Replay(path, config, torch.device(device),
                        table_device=device if on_device else "cpu", known=known,
                        counts=counts)
    replay.replay(trace)
    calls = {kind: count / len(trace) for kind, count in runtime.calls.items()}
    calls["total"] = sum(calls.values())
    return calls


def measure_trace(config: TraceConfig, steps: int, *, repeats: int = 5, seed: int = 0,
                  device_route: bool = False, rows: Optional[tuple] = None
                  ) -> Dict[str, Any]:
    """Time and count every row (default ``ROWS``) over a ``steps``-step trace (see
    the module docstring)."""
    torch.set_num_threads(1)
    trace = make_trace(config, steps, seed=seed)
    known = known_syncs(config, trace)
    rows = (ROWS if rows is None else rows) + (DEVICE_ROWS if device_route else ())
    meta_trace = device_inputs(trace, "meta") if device_route else trace
    result: Dict[str, Any] = {
        "geometry": {"R": config.max_requests, "W": config.block_columns,
                     "BS": config.block_size, "K": config.depths},
        "shape": trace_shape_stats(trace), "micro_us_stock_meta": micro_us(), "rows": {}}
    with cpp_meta_kernels() as info:
        result["micro_us_cpp_meta"] = micro_us()
        replays, inputs = {}, {}
        for label, path, device, on_device, with_counts, threads in rows:
            key = f"{label} @{device}"
            replays[key] = Replay(path, config, torch.device(device),
                                  table_device=device if on_device else "cpu",
                                  known=known if (path in ("reference", "drop-in")
                                                  and device == "meta")
                                  else None, counts=with_counts,
                                  table_threads=threads)
            inputs[key] = meta_trace if on_device else trace
        counts, used = {}, set()
        for key, replay in replays.items():  # warm (JIT, plans), then count
            replay.replay(inputs[key])
            counts[key] = _counts(replay, inputs[key])
            if key.endswith("@meta"):
                used |= counts[key].pop("overloads")
            else:
                counts[key].pop("overloads")
        result["meta_setup"] = {**meta_setup_report(sorted(used, key=str), info),
                                "redirected": info["redirected"],
                                "kept_python": len(info["kept_python"])}
        samples: Dict[str, List[List[float]]] = {key: [] for key in replays}
        order = list(replays)
        rng = np.random.default_rng(seed)
        for _ in range(repeats):
            for index in rng.permutation(len(order)):
                key = order[index]
                samples[key].append(_timed_pass(replays[key], inputs[key]))
        for (label, path, device, on_device, with_counts, threads), key in zip(rows,
                                                                             replays):
            per_step = [statistics.median(s) for s in zip(*samples[key])]
            row = {"label": label, "path": path, "device": device,
                   "device_inputs": on_device, "median_us": statistics.median(per_step),
                   "p90_us": _percentile(per_step, 90), **counts[key],
                   "block_counts": with_counts, "table_threads": threads,
                   "runtime_calls": _runtime_calls(path, config, inputs[key], device,
                                                   on_device, replays[key].known,
                                                   with_counts)}
            if device == "meta":
                row["launch_estimate_us"] = (row["median_us"]
                                             + LAUNCH_US * row["device_data_ops"])
            result["rows"][key] = row
    for key, row in result["rows"].items():
        base = result["rows"][f"reference @{row['device']}"]
        if row["device_inputs"]:
            base = result["rows"]["reference, device inputs @meta"]
        row["speedup_vs_reference"] = base["median_us"] / row["median_us"]
        if "launch_estimate_us" in row:
            row["launch_speedup_vs_reference"] = (base["launch_estimate_us"]
                                                  / row["launch_estimate_us"])
    return result


def run_trace(args: Any) -> int:
    """``mtpmeta bench --trace``: check, then time and print both geometries; 1 when a
    path's view or buffers differ from the reference's on a trace step (CPU), else 0.
    ``args``: ``quick``, ``repeats``, ``seed``, ``json`` (the results under "trace")."""
    import json
    import sys

    from mtpmeta.bench.trace_replay import check_trace

    out: Dict[str, Any] = {}
    for name, (config, steps) in trace_geometries(args.quick).items():
        wide = config is PRODUCTION_WIDE_TRACE  # the check's CPU replays: a few steps
        if wide:  # the mirror path only, with and without counts (memory, time)
            mismatch = check_trace(config, make_trace(config, 4, seed=args.seed),
                                   paths=("mirror",), counts=("mirror",),
                                   device_inputs=False, threaded=("mirror",))
        else:
            mismatch = check_trace(config, make_trace(config, steps, seed=args.seed))
        if mismatch:
            print(f"mtpmeta bench: RESULTS DIFFER ({name} trace): {mismatch}",
                  file=sys.stderr)
            return 1
        print(f"{name} trace: " + (
            "mirror, with and without block counts and on two table threads, leaves "
            "the reference's view and buffers on the first 4 steps (CPU)" if wide
            else f"direct, mirror, captured, mirror with device inputs and the drop-in, "
            f"the first three with block counts, and mirror and captured on two table "
            f"threads with and without them, leave the reference's view and buffers "
            f"on all {steps} steps (CPU)"))
        out[name] = measure_trace(config, steps, repeats=args.repeats or
                                  (2 if args.quick else 5), seed=args.seed,
                                  device_route=name == "standard",
                                  rows=WIDE_ROWS if wide else
                                  ROWS + THREADED_ROWS if name == "production" else None)
        print(format_trace(name, out[name]))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"trace": out}, handle, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


def _row_line(row: Dict[str, Any]) -> str:
    calls = row["runtime_calls"]
    events = f"{calls['total']:.1f}" if calls else "-"
    ops = row["device_data_ops"] if row["device"] != "cpu" else row["data_ops"]
    estimate = (f"{row['launch_estimate_us']:>8,.0f} ({row['launch_speedup_vs_reference']:.2f}x)"
                if "launch_estimate_us" in row else f"{'-':>16}")
    return (f"  {row['label']:<26}{row['device']:<5}{row['median_us']:>8,.0f} "
            f"{row['p90_us']:>8,.0f} {row['speedup_vs_reference']:>6.2f}x  {estimate}"
            f"{ops:>8.1f}{row['syncs']:>7.2f}{events:>8}")


def format_trace(name: str, result: Dict[str, Any]) -> str:
    """The trace table of one geometry."""
    g, s = result["geometry"], result["shape"]
    stock, cpp = result["micro_us_stock_meta"], result["micro_us_cpp_meta"]
    setup = result["meta_setup"]
    lines = [
        f"trace, {name} geometry (R {g['R']}, W {g['W']}, BS {g['BS']}, K {g['K']}): "
        f"{s['steps']} steps, n {s['active_min']}-{s['active_max']}, "
        f"{s['distinct_n_padded']} distinct (n, padded), {s['distinct_commit_tokens']} "
        f"commit token counts; {s['moves']} move, {s['swaps']} swap, {s['resets']} reset "
        f"steps, {s['carries']} carries, {s['prefix_hits']} prefix hits",
        f"  meta device with the C++ meta kernels: cumsum {stock['cumsum']:.0f} -> "
        f"{cpp['cumsum']:.1f} µs, floor_divide {stock['floor_divide']:.0f} -> "
        f"{cpp['floor_divide']:.1f} µs per call; ops served by a Python meta kernel: "
        f"{', '.join(setup['python_used']) or 'none'}; redirected: "
        f"{', '.join(setup['redirected_used']) or 'none'}",
        f"  {'path':<26}{'dev':<5}{'median':>8} {'p90':>8} {'vs ref':>7}  "
        f"{'+4µs/op est.':>16}{'ops':>8}{'syncs':>7}{'ev/str':>8}   (µs per step)"]
    lines += [_row_line(row) for row in result["rows"].values()]
    lines.append("  vs ref: the reference's µs over the row's, same device (and inputs); "
                 "ops: device data ops per step (meta rows; CPU rows: all data ops); "
                 "syncs: read-backs per step (the reference's, answered from the host on "
                 "meta); ev/str: CUDA event and stream calls per step (mirror path)")
    return "\n".join(lines)
