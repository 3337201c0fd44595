"""Timing for ``mtpmeta bench``: whole steps, method groups, counts, sweep, cold start.

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

from . import floor
from mtpmeta.bench.variants import Variant, build, implementations, inputs_of, variants
from mtpmeta.bench.opcount import OpCounter
from mtpmeta.bench.workload import StepConfig, StepInputs, make_steps, run_step, run_step_groups

__all__ = ["measure", "sweep", "cold_start", "load_now", "machine_load"]

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
    prepared = floor.prepare(steps)
    converting = [floor.TorchFloorInputs(step, bare_inputs)
                  for step, bare_inputs in zip(steps, prepared)]
    runs: List[_Run] = []
    for label, batch in (("kernel floor", prepared),
                         ("kernel floor, torch inputs", converting)):
        runs.append(_Run(
            label, lambda inputs: floor.floor_step(bare, bare_view, inputs, config),
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


def sweep(config: StepConfig, actives: List[int], repeats: int, device: torch.device,
          steps: int, spread: Optional[Dict[str, Dict[int, Tuple[float, float]]]] = None
          ) -> Dict[str, Dict[int, float]]:
    """Median µs per step of each path (torch inputs, eager) over batch sizes; a
    ``spread`` dict given gets each cell's lowest and highest pass (for the plot)."""
    results: Dict[str, Dict[int, float]] = {name: {} for name in implementations(device)}
    for active in actives:
        sized = replace(config, active=active,
                        max_requests=max(config.max_requests, active + 1))
        rows, _ = measure(sized, make_steps(sized, steps), repeats, device,
                          with_floor=False)
        for name in results:
            row = rows[Variant(name).label]
            results[name][active] = row["us_per_step"]
            if spread is not None:
                passes = row["us_by_pass"]
                spread.setdefault(name, {})[active] = (min(passes), max(passes))
    return results


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
