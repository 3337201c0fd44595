"""Timing for ``mtpmeta bench``: whole steps, method groups, counts, the captured draft
loop's host side, cold start, and the machine's load while timing.

Every repeat runs one pass of each variant (and of the CPU kernel floors), so a load
change hits every row alike; the figures are medians over the repeats, in µs per step.
Each pass runs the rows in a fresh seeded random order: a row timed right after a heavy
one pays that row's cache misses, and with a fixed order the torch-input kernel floor
(always right after the numpy floor, on the same buffers) read faster than the numpy
floor it adds work to. Ratios between rows of one run are what the bench reports;
absolute times only compare on the same machine.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mtpmeta.bench.counters import OpCounter
from mtpmeta.bench.variants import TorchFloorInputs, Variant, build, floor_inputs, \
    floor_step, implementations, inputs_of, variants
from mtpmeta.bench.workload import StepConfig, StepInputs, run_commit, run_draft, run_step, \
    run_step_groups
from mtpmeta.gpu_view import ContextGPUView
from mtpmeta.mirror.captured_route import ADVANCE_OPS, DEPTH_OPS

__all__ = ["measure", "measure_captured", "cuda_syncs", "cold_start", "new_view_cost",
           "load_now",
           "machine_load"]

_COLD_START = """
import time, sys
t0 = time.perf_counter()
from mtpmeta.gpu_view import ContextGPUView
from mtpmeta.metadata import MTPMetadata
from mtpmeta.bench.workload import StepConfig, make_steps, run_step
config = StepConfig(**{config})
inputs = make_steps(config, 1)[0]
meta = MTPMetadata(**config.metadata_kwargs())
meta.allocate("cpu")
view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
run_step(meta, view, inputs, config)
print(time.perf_counter() - t0)
"""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class _Run:
    """A built variant (or the kernel floor) being timed."""

    label: str
    step: Callable[[Any], None]  # runs one step's inputs
    steps: List[Any]
    groups: Optional[Callable[[Any, Dict[str, int]], None]] = None
    per_step: List[float] = field(default_factory=list)
    per_group: Dict[str, List[float]] = field(default_factory=dict)

    def time_steps(self, device: torch.device) -> None:
        _sync(device)
        start = time.perf_counter_ns()
        for inputs in self.steps:
            self.step(inputs)
        _sync(device)
        self.per_step.append((time.perf_counter_ns() - start) / len(self.steps) / 1e3)

    def time_groups(self, device: torch.device) -> None:
        if self.groups is None:
            return
        totals = dict.fromkeys(run_step_groups, 0)
        _sync(device)
        for inputs in self.steps:
            self.groups(inputs, totals)
        _sync(device)
        for group, total in totals.items():
            self.per_group.setdefault(group, []).append(total / len(self.steps) / 1e3)


def _variant_run(variant: Variant, config: StepConfig, steps: List[StepInputs],
                 device: torch.device):
    config = variant.config(config)
    meta, view = build(variant.impl, config, device)
    for inputs in steps:  # warm-up: JIT, per-shape caches
        run_step(meta, view, inputs, config)

    def groups(inputs: StepInputs, totals: Dict[str, int]) -> None:
        for group, run in run_step_groups.items():
            t0 = time.perf_counter_ns()
            run(meta, view, inputs, config)
            totals[group] += time.perf_counter_ns() - t0

    run = _Run(variant.label, lambda inputs: run_step(meta, view, inputs, config), steps,
               groups)
    return run, meta, view, config


def cuda_syncs(run: Callable[[], None]) -> int:
    """Host-device syncs CUDA reports while ``run()`` runs: every synchronizing call
    PyTorch checks under ``torch.cuda.set_sync_debug_mode("warn")`` (``.item()``,
    blocking uploads and read-backs, ``repeat_interleave`` and ``nonzero`` sizing),
    one warning each."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


def _counts(meta: Any, view: Any, config: StepConfig,
            steps: List[StepInputs]) -> Dict[str, Any]:
    """Torch ops, syncs and draft-loop allocations of one warm step. Syncs: on CUDA,
    every sync CUDA reports (``cuda_syncs``); on the CPU, the scalar reads (what would
    sync on a device)."""
    with OpCounter() as step_counter:
        run_step(meta, view, steps[0], config)
    syncs = step_counter.scalar_reads
    if view.token_to_block_idx.is_cuda:
        torch.cuda.synchronize()
        syncs = cuda_syncs(lambda: run_step(meta, view, steps[0], config))
    inputs = steps[1 % len(steps)]
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, config.graphed)
    with OpCounter() as draft_counter:
        for _ in range(config.depths):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
    return {"ops_per_step": step_counter.total, "data_ops_per_step": step_counter.data_ops,
            "ops_by_name": dict(step_counter.ops),
            "syncs_per_step": syncs,
            "draft_loop_allocations": draft_counter.new_storages}


def fence_stalls(meta: Any) -> Optional[int]:
    """The mirror path's fence waits that blocked the host so far (``None`` off it)."""
    return getattr(getattr(meta, "_backend", None), "fence_stalls", None)


def _floor_runs(config: StepConfig, steps: List[StepInputs],
                device: torch.device) -> List[_Run]:
    """The CPU kernel floors, warmed: on pre-converted inputs, and converting each
    torch input as it is read."""
    bare, bare_view = build("direct", config, device)
    prepared = floor_inputs(steps)
    converting = [TorchFloorInputs(step, bare_inputs)
                  for step, bare_inputs in zip(steps, prepared)]
    runs: List[_Run] = []
    for label, batch in (("kernel floor", prepared),
                         ("kernel floor, torch inputs", converting)):
        runs.append(_Run(
            label, lambda inputs: floor_step(bare, bare_view, inputs, config),
            batch))
        runs[-1].time_steps(device)  # warm-up
        runs[-1].per_step.clear()
    return runs


def measure(config: StepConfig, steps: List[StepInputs], repeats: int,
            device: torch.device, progress: Any = None,
            with_floor: bool = True,
            order_seed: int = 0) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, float]]:
    """Median µs per step and per method group of every variant, with each pass's µs per
    step (``us_by_pass``) and op/sync/allocation counts, and the kernel floors' median
    µs per step (CPU: ``"kernel floor"`` on pre-converted inputs, ``"kernel floor, torch
    inputs"`` converting each torch input as it is read). Every repeat runs one pass of
    each variant and floor, in an order drawn from ``random.Random(order_seed)``, so
    they share the machine's state of the moment and no row always follows the same
    neighbour."""
    by_kind = inputs_of(steps)
    rows = variants(device)
    runs, built = [], {}
    for variant in rows:
        run, meta, view, variant_config = _variant_run(variant, config, by_kind[variant.inputs],
                                                       device)
        runs.append(run)
        built[variant] = (meta, view, variant_config)
    stalls_before = {variant: fence_stalls(built[variant][0]) for variant in rows}
    floor_runs: List[_Run] = []
    if with_floor and device.type == "cpu":
        floor_runs = _floor_runs(config, steps, device)
        runs.extend(floor_runs)
    order = random.Random(order_seed)
    for _ in range(repeats):
        shuffled = order.sample(runs, len(runs))
        for run in shuffled:
            run.time_steps(device)
        for run in shuffled:
            run.time_groups(device)
        if progress is not None:
            progress.update(1)
    results: Dict[str, Dict[str, Any]] = {}
    for variant, run in zip(rows, runs):
        meta, view, variant_config = built[variant]
        groups = {group: statistics.median(values) for group, values in run.per_group.items()}
        groups["draft depth"] /= config.depths
        stalls = fence_stalls(meta)
        timed_steps = repeats * len(run.steps) * (2 if run.groups is not None else 1)
        results[variant.label] = {
            "impl": variant.impl, "inputs": variant.inputs, "draft": variant.draft,
            "us_per_step": statistics.median(run.per_step), "us_by_pass": run.per_step,
            "us_per_group": groups,
            # Fence waits that blocked the host, per timed step (None off the mirror).
            "fence_stalls_per_step": None if stalls is None else
            (stalls - stalls_before[variant]) / max(timed_steps, 1),
            **_counts(meta, view, variant_config, by_kind[variant.inputs])}
    floors = {run.label: statistics.median(run.per_step) for run in floor_runs}
    return results, floors


def _captured_host_loop(meta: Any, inputs: StepInputs, config: StepConfig) -> None:
    """A captured step's host side of the draft loop (no replay)."""
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, True, capture_setup=True)
    meta.end_forward()


def _best_us_per_step(run: Callable[[StepInputs], None], steps: List[StepInputs],
                      repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter_ns()
        for inputs in steps:
            run(inputs)
        _sync(device)
        best = min(best, (time.perf_counter_ns() - start) / len(steps) / 1e3)
    return best


def measure_captured(config: StepConfig, steps: List[StepInputs], repeats: int,
                     device: torch.device) -> Dict[str, Dict[str, Any]]:
    """What the host pays for a captured draft loop (contract §12), per library path.

    With ``capture_setup=True`` the per-depth setup lives in the CUDA graph the caller
    captured once per padded size, so the host's whole draft loop is one
    ``begin_decode`` and the graph replays (device work the caller launches, excluded
    here). Per path: host µs per step (best of ``repeats``) and data ops, syncs and
    allocations of that host work, the default graphed loop's µs and data ops beside
    it, and the ops one captured depth records into the graph (setup, advance), which
    each replay re-runs on the device; a count that differs from
    ``mtpmeta.mirror.captured_route``'s documented one raises ``RuntimeError``."""
    graphed = replace(config, graphed=True)
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
            "captured_host_us_per_step": _best_us_per_step(
                lambda s: _captured_host_loop(meta, s, graphed), steps, repeats, device),
            "default_graphed_us_per_step": _best_us_per_step(
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
                               f"{advance.data_ops} ops; mtpmeta.mirror.captured_route "
                               f"documents {DEPTH_OPS} + {ADVANCE_OPS}")
    return out


def cold_start(config: StepConfig, warm_runs: int = 3) -> Dict[str, Any]:
    """Seconds to the end of the first step in a new process, given a fresh, empty
    numba cache directory (``NUMBA_CACHE_DIR``) of its own: the first process is truly
    cold and compiles every kernel it runs into that cache; the ``warm_runs`` after it
    load them from there. Single runs swing by 0.2 s here (torch's own import varies
    most), so the warm figure is the median of the runs, all of which are kept;
    ``compile_s`` is the cold run less that median."""
    script = _COLD_START.format(config=repr(asdict(config)))
    times = []
    with tempfile.TemporaryDirectory(prefix="mtpmeta-numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for run in range(1 + warm_runs):
            result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                    text=True, env=env)
            if result.returncode != 0:
                raise RuntimeError(f"cold-start process failed:\n{result.stderr[-2000:]}")
            times.append(float(result.stdout.strip().splitlines()[-1]))
            if run == 0:
                cached_files = sum(len(files) for _, _, files in os.walk(cache))
    warm = statistics.median(times[1:]) if warm_runs else float("nan")
    return {"cold_s": times[0], "warm_s": warm, "warm_runs_s": times[1:],
            "compile_s": times[0] - warm, "cache_files_written": cached_files}


def new_view_cost(config: StepConfig, steps: List[StepInputs],
                  repeats: int = 5) -> Dict[str, float]:
    """ms of a new view's first commit pass and first draft depth on the mirror path
    (CPU), the kernels and the object warm from ``steps`` on another view, beside the
    same call on that view once warm (best of ``repeats``): what an engine pays for each
    view it brings (a CUDA-graph bucket's, a debug view)."""
    meta, view = build("mirror", config, torch.device("cpu"))
    for inputs in steps:
        run_step(meta, view, inputs, config)
    inputs = steps[0]

    def commit(target: Any) -> float:
        start = time.perf_counter()
        run_commit(meta, target, inputs)
        return (time.perf_counter() - start) * 1e3

    def depth(target: Any) -> float:
        meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                          inputs.block_table, config.graphed)
        start = time.perf_counter()
        meta.setup_decode_step(target)
        elapsed = (time.perf_counter() - start) * 1e3
        meta.end_forward()
        return elapsed

    out: Dict[str, float] = {}
    for name, call in (("commit_pass", commit), ("draft_depth", depth)):
        target = ContextGPUView(config.max_requests, config.max_tokens,
                                config.block_columns)
        out[f"{name}_first_ms"] = call(target)
        out[f"{name}_warm_ms"] = min(call(target) for _ in range(repeats))
    return out


def load_now() -> Optional[float]:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_load(before: Optional[float]) -> Dict[str, Any]:
    """The 1-minute load average ``before`` the timing (``load_now()`` then) and now,
    the CPU count, and ``busy``: other processes occupied more than half the CPUs at
    either moment (the bench's own process counts one). Empty without a load average."""
    after = load_now()
    if before is None or after is None:
        return {}
    cpus = os.cpu_count() or 1
    return {"before": before, "after": after, "cpus": cpus,
            "busy": max(before, after) - 1 > cpus / 2}
