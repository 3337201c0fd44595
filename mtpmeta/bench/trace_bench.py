"""``mtpmeta bench --trace``: µs per step of every path over a seeded trace.

For each geometry (standard: R 256, W 128; production: R 1024, W 2048, K 3; and the
production traffic at W 8192) the trace (``mtpmeta.bench.trace``) is first replayed on
the CPU through the reference and every path a row of that geometry times, which must
leave the reference's view and buffers (``trace_replay.check_trace``; exit status 1
if not). Then each row is timed in interleaved passes of one run, on torch's ``meta``
device with the C++ meta kernels (``mtpmeta.bench.meta_device``: the host's share of a
GPU step) or on the CPU (the direct path, a CPU deployment), timed inside
``torch.inference_mode()``, where Megatron's controller runs the MTP helpers (each
row's objects built outside it, as the engine builds its context; outside it every
torch op also passes autograd's dispatch, which upstream's many ops pay most for).
Ops and syncs are counted outside it, where torch's dispatch modes see every aten op
(inside it they see an ``aten::to`` whole, and ``.item()`` on the CPU not at all).
Per row: the median and p90 over steps of each step's median over passes, the
ratio against the reference on the same device (and inputs) and its lowest and
highest pass by pass (each pass's median step; the verdict and targets print them),
device data ops, syncs and CUDA event/stream calls per step
(``counters.CountingRuntime``), and the launch-cost estimate "meta µs + 4 µs per
device data op". The read-backs on meta are answered from the host with the values a
CPU replay of the trace read (``trace_replay.known_syncs``): the reference's
(``HostKnownReference``) and the patched helpers' of the client's device inputs
(``engine_placement.PlacementRuntime``); ``syncs`` counts them.

What each row tells a scheduler author: ``megatron, engine placement`` (the headline)
is Megatron's engine as its client really calls (device commit inputs, the context's
host table; ``mtpmeta.bench.engine_placement``) through the helpers ``patch()``
installs, against upstream's helpers on the same placement (``reference, engine
placement``), every read-back answered from the trace and counted, with its bytes
(``D2H B``); ``..., byte-exact`` is the same with ``patch(block_counts=False)``
(``megatron.helpers``); ``mirror`` is the default call on a GPU,
``captured`` the opt-in captured draft loop (contract §12), ``megatron, patched
helpers`` an engine on upstream's call sites after ``mtpmeta.integrations.megatron.
patch()`` (the context's helpers, one fused call each), ``block counts`` the
opt-in ``block_counts=`` (contract §5), ``device inputs`` passing the draft loop's inputs as
device tensors, ``drop-in`` keeping upstream's call sites with mtpmeta's writers; the
W 8192 geometry shows whether host cost follows the blocks in use or the table's width.

To add a row, append a :class:`TraceRow` to ``ROWS`` (a new path first registers how
its objects are built in ``trace_replay.PATHS``): the check, the timing, the table, the
JSON and the verdict all read ``ROWS``.

Progress goes to stderr as each section starts; results go to stdout as each section
ends, flushed (``trace_report``), then the machine's load (a warning when it was
busy), with ``--targets`` the trace targets, and a closing ``verdict:`` line.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from mtpmeta.bench.counters import CountingRuntime, DeviceOpCounter
from mtpmeta.bench.meta_device import cpp_meta_kernels, meta_setup_report, micro_us
from mtpmeta.bench.trace import PRODUCTION_TRACE, PRODUCTION_WIDE_TRACE, STANDARD_TRACE, \
    TraceConfig, TraceStep, make_trace, trace_shape_stats
from mtpmeta.bench.trace_replay import Replay, device_inputs, known_syncs
from mtpmeta.bench.trace_report import ENGINE_KEY, ENGINE_REFERENCE_KEY, MEGATRON_KEY, \
    TRACE_TARGETS_NOTE, checked_line, format_trace, growth_text, trace_target_lines, \
    verdict_line, width_growth
from mtpmeta.buffers.device_runtime import use_runtime

__all__ = ["LAUNCH_US", "MEGATRON_KEY", "ENGINE_KEY", "ENGINE_REFERENCE_KEY", "TraceRow",
           "ROWS", "rows_for", "trace_geometries", "measure_trace", "run_trace"]

LAUNCH_US = 4.0  # the CUDA driver's launch cost per device data op, for the estimate
ALL = ("standard", "production", "production W 8192")
#: Geometries whose agreement check replays only this many steps: at W 8192 each CPU
#: replay holds several [R, W] tables, and the first steps already exercise every call.
CHECK_STEPS = {"production W 8192": 4}


@dataclass(frozen=True)
class TraceRow:
    """One timed row: ``path`` (a name in ``trace_replay.PATHS``) on ``device``, with
    the draft loop's inputs as device tensors (``device_inputs``), the calls given the
    step's ``block_counts``; timed on the ``geometries`` named. Its baseline is the reference row of the same device and
    inputs, which must be in ``ROWS`` for those geometries."""

    label: str
    path: str
    device: str = "meta"
    device_inputs: bool = False
    block_counts: bool = False
    geometries: Tuple[str, ...] = ALL
    baseline: str = ""  # the reference row's label, when not the default's

    @property
    def key(self) -> str:
        return f"{self.label} @{self.device}"

    @property
    def baseline_key(self) -> str:
        """The key of the reference row this row's ratio is taken against."""
        label = self.baseline or ("reference, device inputs" if self.device_inputs
                                  else "reference")
        return f"{label} @{self.device}"


#: Every row of the trace bench, in printed order: the one place a row is added.
ROWS = (
    TraceRow("reference, engine placement", "upstream engine",
             geometries=("standard", "production"), baseline="reference, engine placement"),
    TraceRow("megatron, engine placement", "megatron engine",
             block_counts=True, geometries=("standard", "production"),
             baseline="reference, engine placement"),
    TraceRow("megatron, engine placement, byte-exact", "megatron engine",
             geometries=("standard", "production"), baseline="reference, engine placement"),
    TraceRow("reference", "reference"),
    TraceRow("mirror", "mirror"),
    TraceRow("captured", "captured"),
    TraceRow("megatron, patched helpers", "megatron", geometries=("standard", "production")),
    TraceRow("mirror, block counts", "mirror", block_counts=True),
    TraceRow("captured, block counts", "captured", block_counts=True,
             geometries=("standard", "production")),
    TraceRow("reference, device inputs", "reference", device_inputs=True,
             geometries=("standard",)),
    TraceRow("mirror, device inputs", "mirror", device_inputs=True,
             geometries=("standard",)),
    TraceRow("drop-in, device inputs", "drop-in", device_inputs=True,
             geometries=("standard",)),
    TraceRow("reference", "reference", device="cpu", geometries=("standard", "production")),
    TraceRow("direct", "direct", device="cpu", geometries=("standard", "production")),
)


def rows_for(geometry: str) -> Tuple[TraceRow, ...]:
    """The rows timed on ``geometry`` (a name of ``trace_geometries``; a geometry no
    row names gets every row meant for all of them)."""
    rows = tuple(row for row in ROWS if geometry in row.geometries)
    return rows or tuple(row for row in ROWS if row.geometries == ALL)


def trace_geometries(quick: bool) -> Dict[str, Tuple[TraceConfig, int]]:
    """``{name: (TraceConfig, steps)}``: full length, or short with ``quick``."""
    return {"standard": (STANDARD_TRACE, 40 if quick else STANDARD_TRACE.steps),
            "production": (PRODUCTION_TRACE, 12 if quick else PRODUCTION_TRACE.steps),
            "production W 8192": (PRODUCTION_WIDE_TRACE,
                                  6 if quick else PRODUCTION_WIDE_TRACE.steps)}


def _timed_pass(replay: Replay, trace: List[TraceStep]) -> List[float]:
    """µs of each step's calls (``run``; ``prepare`` is untimed), collector off."""
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
    table update is 3 device ops on a step that grows a device table. Syncs: the
    scalar reads plus the read-backs answered from the host (``Replay.read_backs``);
    ``d2h_bytes``: the bytes those read back."""
    reads, read_bytes = replay.read_backs()
    data_ops = device_data_ops = scalar_reads = 0
    overloads: set = set()
    is_device = replay.runtime.is_device if replay.runtime is not None else None
    replay.reset()
    for index, step in enumerate(trace):
        replay.prepare(index, step)
        with DeviceOpCounter(is_device) as counter:
            replay.run(step)
        data_ops += counter.data_ops
        device_data_ops += counter.device_data_ops
        scalar_reads += counter.scalar_reads
        overloads |= counter.overloads
    steps = len(trace)
    reads_after, bytes_after = replay.read_backs()
    return {"data_ops": data_ops / steps, "device_data_ops": device_data_ops / steps,
            "syncs": (scalar_reads + reads_after - reads) / steps,
            "d2h_bytes": (bytes_after - read_bytes) / steps, "overloads": overloads}


#: Per step, the values a CPU replay read back, by ``known_syncs``'s ``(path, counts)``.
Known = Dict[Tuple[str, bool], List[List[Any]]]


def known_sequence(row: TraceRow) -> Tuple[str, bool]:
    """Whose read-backs ``row``'s replay makes, as ``known_syncs``'s ``(path, counts)``:
    the engine-placement paths their own, every other path the reference's."""
    if row.path in ("upstream engine", "megatron engine"):
        return row.path, row.block_counts
    return "reference", False


def _replay(row: TraceRow, config: TraceConfig, known: Known) -> Replay:
    """``row``'s replay; on meta, a path that reads back gets the host's values
    (``known``, by :func:`known_sequence`)."""
    return Replay(row.path, config, torch.device(row.device),
                  table_device=row.device if row.device_inputs else "cpu",
                  known=known.get(known_sequence(row)) if row.device == "meta" else None,
                  counts=row.block_counts)


def _runtime_calls(row: TraceRow, config: TraceConfig, trace: List[TraceStep],
                   known: Known) -> Optional[Dict[str, float]]:
    if row.path in ("reference", "upstream engine") or row.device == "cpu":
        return None
    runtime = CountingRuntime()
    with use_runtime(runtime):
        replay = _replay(row, config, known)
    replay.replay(trace)
    calls = {kind: count / len(trace) for kind, count in runtime.calls.items()}
    calls["total"] = sum(calls.values())
    return calls


def measure_trace(config: TraceConfig, steps: int, *, repeats: int = 5, seed: int = 0,
                  rows: Optional[Tuple[TraceRow, ...]] = None,
                  note: Callable[[str], None] = lambda text: None) -> Dict[str, Any]:
    """Time and count ``rows`` (default: the standard geometry's) over a ``steps``-step
    trace (see the module docstring); ``note`` hears of each pass as it starts."""
    torch.set_num_threads(1)
    rows = rows_for("standard") if rows is None else rows
    trace = make_trace(config, steps, seed=seed)
    known = {sequence: known_syncs(config, trace, *sequence)
             for sequence in {known_sequence(row) for row in rows if row.device == "meta"}}
    meta_trace = device_inputs(trace, "meta") if any(r.device_inputs for r in rows) \
        else trace
    result: Dict[str, Any] = {
        "geometry": {"R": config.max_requests, "W": config.block_columns,
                     "BS": config.block_size, "K": config.depths},
        "shape": trace_shape_stats(trace), "micro_us_stock_meta": micro_us(), "rows": {}}
    with cpp_meta_kernels() as info:
        result["micro_us_cpp_meta"] = micro_us()
        replays = {row.key: _replay(row, config, known) for row in rows}
        inputs = {row.key: meta_trace if row.device_inputs else trace for row in rows}
        note(f"warming and counting {len(rows)} rows")
        counts, used = {}, set()
        for row in rows:  # warm (JIT, plans), then count
            replays[row.key].replay(inputs[row.key])
            counts[row.key] = _counts(replays[row.key], inputs[row.key])
            overloads = counts[row.key].pop("overloads")
            if row.device == "meta":
                used |= overloads
        samples: Dict[str, List[List[float]]] = {row.key: [] for row in rows}
        with torch.inference_mode():  # the engine's step mode (module docstring)
            for row in rows:
                replays[row.key].replay(inputs[row.key])
            rng = np.random.default_rng(seed)
            for number in range(repeats):
                note(f"pass {number + 1} of {repeats}")
                for index in rng.permutation(len(rows)):
                    key = rows[index].key
                    samples[key].append(_timed_pass(replays[key], inputs[key]))
        result["meta_setup"] = {**meta_setup_report(sorted(used, key=str), info),
                                "redirected": info["redirected"],
                                "kept_python": len(info["kept_python"])}
        for row in rows:
            per_step = [statistics.median(s) for s in zip(*samples[row.key])]
            out = {"label": row.label, "path": row.path, "device": row.device,
                   "device_inputs": row.device_inputs, "baseline": row.baseline_key,
                   "median_us": statistics.median(per_step),
                   # each pass's median step: the spread of the ratio from pass to pass
                   "pass_us": [statistics.median(s) for s in samples[row.key]],
                   "p90_us": float(np.percentile(per_step, 90)), **counts[row.key],
                   "block_counts": row.block_counts,
                   "runtime_calls": _runtime_calls(row, config, inputs[row.key], known)}
            if row.device == "meta":
                out["launch_estimate_us"] = out["median_us"] + LAUNCH_US * out[
                    "device_data_ops"]
            result["rows"][row.key] = out
    for row in result["rows"].values():
        base = result["rows"][row["baseline"]]
        row["speedup_vs_reference"] = base["median_us"] / row["median_us"]
        # the passes of the row and its reference in the same round, a ratio each
        row["pass_speedups"] = [b / r for b, r in zip(base["pass_us"], row["pass_us"])]
        if "launch_estimate_us" in row:
            row["launch_speedup_vs_reference"] = (base["launch_estimate_us"]
                                                  / row["launch_estimate_us"])
    return result


def _check_arguments(rows: Tuple[TraceRow, ...]) -> Dict[str, Any]:
    """``check_trace``'s keyword arguments that replay every path ``rows`` time."""
    paths = tuple(dict.fromkeys(row.path for row in rows if row.path != "reference"))
    return {"paths": paths,
            "counts": tuple(dict.fromkeys(r.path for r in rows if r.block_counts)),
            "device_inputs": any(r.device_inputs and r.path == "mirror" for r in rows)}


def run_trace(args: Any) -> int:
    """``mtpmeta bench --trace``: per geometry, check then time and print; 1 when a
    path's view or buffers differ from the reference's on a trace step (CPU), else 0
    after the verdict. ``args``: ``quick``, ``repeats``, ``seed``, ``json`` (the
    results under "trace"), ``targets``. A busy machine is named under the tables, as
    the standard bench names it (``measure.machine_load``)."""
    import json

    from mtpmeta.bench import trace_replay
    from mtpmeta.bench.measure import load_now, machine_load
    from mtpmeta.bench.report import load_lines, note

    geometries = trace_geometries(args.quick)
    repeats = args.repeats or (2 if args.quick else 5)
    note(f"trace: {len(geometries)} geometries ({', '.join(geometries)}), each checked "
         f"against the reference on the CPU, then timed in {repeats} interleaved passes "
         f"inside torch.inference_mode()")
    out: Dict[str, Any] = {}
    checked: Dict[str, int] = {}
    load_before = load_now()
    for name, (config, steps) in geometries.items():
        rows = rows_for(name)
        arguments = _check_arguments(rows)
        check_steps = min(steps, CHECK_STEPS.get(name, steps))
        note(f"{name} trace: checking {', '.join(arguments['paths'])} against the "
             f"reference on {check_steps} steps")
        mismatch = trace_replay.check_trace(
            config, make_trace(config, check_steps, seed=args.seed), **arguments)
        if mismatch:
            print(f"mtpmeta bench: RESULTS DIFFER ({name} trace): {mismatch}",
                  file=sys.stderr, flush=True)
            return 1
        checked[name] = check_steps
        print(checked_line(name, check_steps, arguments), flush=True)
        note(f"{name} trace: timing {len(rows)} rows over {steps} steps")
        out[name] = measure_trace(config, steps, repeats=repeats, seed=args.seed,
                                  rows=rows,
                                  note=lambda text, name=name: note(f"{name} trace: {text}"))
        print(format_trace(name, out[name]), flush=True)
    load = machine_load(load_before)
    for line in load_lines(load, "p90 against the median",
                           "the ops, syncs and bytes") if load else ():
        print(line, flush=True)
    growth = width_growth(out)
    if growth is not None:
        print(f"capacity, {growth_text(growth)} (near 1: the host cost follows the "
              f"blocks in use, not the table's width)", flush=True)
    if getattr(args, "targets", False):
        print(TRACE_TARGETS_NOTE)
        for line in trace_target_lines(out, growth):
            print(f"target: {line}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"trace": out, "load": load}, handle, indent=2, default=str)
        print(f"wrote {args.json}", flush=True)
    print(verdict_line(out, checked, growth), flush=True)
    return 0
