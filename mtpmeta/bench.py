"""``mtpmeta bench``: per-step host cost of the library against the pure-torch reference.

Runs the standard step (``mtpmeta.workload``) through the direct path, the mirror path
and the reference; first checks that all three leave identical view contents and
buffers (exit status 1 if not), then times whole steps and each method group, counts
torch ops, syncs and draft-loop allocations, and prints a table. Ratios are measured in
the same run, side by side; absolute times only compare on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional

import torch

from . import floor
from .gpu_view import VIEW_FIELDS, ContextGPUView
from .metadata import MTPMetadata
from .opcount import OpCounter
from .reference import ReferenceGPUView, ReferenceMTPMetadata
from .workload import StepConfig, StepInputs, make_steps, run_step, run_step_groups

__all__ = ["main", "measure", "build"]

IMPLEMENTATIONS = ("reference", "direct", "mirror")
_COLD_START = """
import time, sys
t0 = time.perf_counter()
from mtpmeta import MTPMetadata, ContextGPUView
from mtpmeta.workload import StepConfig, make_steps, run_step
config = StepConfig(**{config})
inputs = make_steps(config, 1)[0]
meta = MTPMetadata(**config.metadata_kwargs())
meta.allocate("cpu")
view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
run_step(meta, view, inputs, config)
print(time.perf_counter() - t0)
"""


def build(name: str, config: StepConfig, device: torch.device):
    """``(metadata, view)`` of one implementation, allocated on ``device``."""
    if name == "reference":
        meta: Any = ReferenceMTPMetadata(**config.metadata_kwargs())
        meta.allocate(device)
        return meta, ReferenceGPUView(config.max_requests, config.max_tokens,
                                      config.block_columns, device)
    meta = MTPMetadata(**config.metadata_kwargs())
    meta.allocate(device, mirror=(name == "mirror"), max_tokens=config.max_tokens)
    return meta, ContextGPUView(config.max_requests, config.max_tokens,
                                config.block_columns, device)


def _state(meta: Any, view: Any) -> Dict[str, torch.Tensor]:
    state = {f.name: getattr(view, f.name).cpu() for f in VIEW_FIELDS}
    for name in ("request_matched_prefix_blocks", "offsets", "block_table",
                 "query_lengths", "kv_lengths", "chunk_boundary_hidden"):
        state[name] = getattr(meta, name).cpu()
    return state


def check_identical(config: StepConfig, steps: List[StepInputs],
                    device: torch.device) -> Optional[str]:
    """Run every implementation through ``steps``; describe the first difference."""
    runs = {name: build(name, config, device) for name in IMPLEMENTATIONS}
    for index, inputs in enumerate(steps):
        states = {}
        for name, (meta, view) in runs.items():
            run_step(meta, view, inputs, config)
            states[name] = _state(meta, view)
        for name in ("direct", "mirror"):
            for key, expected in states["reference"].items():
                if not torch.equal(states[name][key], expected.to(states[name][key].dtype)):
                    return f"step {index}: {name} differs from the reference in {key}"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name: str, config: StepConfig, steps: List[StepInputs], repeats: int,
            device: torch.device, progress: Any = None) -> Dict[str, Any]:
    """Median µs per step and per method group, plus op/sync/allocation counts."""
    meta, view = build(name, config, device)
    for inputs in steps:  # warm-up: JIT, per-shape caches
        run_step(meta, view, inputs, config)
    per_step: List[float] = []
    per_group: Dict[str, List[float]] = {group: [] for group in run_step_groups}
    for _ in range(repeats):
        _sync(device)
        group_ns = dict.fromkeys(run_step_groups, 0)
        start = time.perf_counter_ns()
        for inputs in steps:
            for group, run in run_step_groups.items():
                t0 = time.perf_counter_ns()
                run(meta, view, inputs, config)
                group_ns[group] += time.perf_counter_ns() - t0
        _sync(device)
        per_step.append((time.perf_counter_ns() - start) / len(steps) / 1e3)
        for group, total in group_ns.items():
            per_group[group].append(total / len(steps) / 1e3)
        if progress is not None:
            progress.update(1)
    with OpCounter() as step_counter:
        run_step(meta, view, steps[0], config)
    inputs = steps[1 % len(steps)]
    padded = -(-config.active // config.tp) * config.tp
    meta.begin_decode(config.active, padded, inputs.start_positions, inputs.block_table,
                      False)
    with OpCounter() as draft_counter:
        for _ in range(config.depths):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
    groups = {group: statistics.median(values) for group, values in per_group.items()}
    groups["draft depth"] /= config.depths
    return {
        "us_per_step": statistics.median(per_step),
        "us_per_group": groups,
        "ops_per_step": step_counter.total,
        "syncs_per_step": step_counter.scalar_reads,
        "draft_loop_allocations": draft_counter.new_storages,
    }


def kernel_floor(config: StepConfig, steps: List[StepInputs],
                 repeats: int) -> Dict[str, Any]:
    """Median µs per step of the direct path's kernels alone (``mtpmeta.floor``), after
    checking that they leave the same view and buffers as the full direct path."""
    full, full_view = build("direct", config, torch.device("cpu"))
    bare, bare_view = build("direct", config, torch.device("cpu"))
    prepared = floor.prepare(steps)
    for inputs, bare_inputs in zip(steps, prepared):
        run_step(full, full_view, inputs, config)
        floor.floor_step(bare, bare_view, bare_inputs, config)
    expected, actual = _state(full, full_view), _state(bare, bare_view)
    same = all(torch.equal(actual[key], value) for key, value in expected.items())
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for inputs in prepared:
            floor.floor_step(bare, bare_view, inputs, config)
        per_step.append((time.perf_counter_ns() - start) / len(prepared) / 1e3)
    return {"us_per_step": statistics.median(per_step), "same_result": same}


def cold_start(config: StepConfig, warm_runs: int = 3) -> Dict[str, Any]:
    """Seconds to the end of the first step in a new process: once with numba's cache
    as it is (compiling what is missing), then ``warm_runs`` times with it warm. Single
    runs swing by 0.2 s here (torch's own import varies most), so the warm figure is
    the median of the runs, all of which are kept."""
    script = _COLD_START.format(config=repr(asdict(config)))
    times = []
    for _ in range(1 + warm_runs):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"cold-start process failed:\n{result.stderr[-2000:]}")
        times.append(float(result.stdout.strip().splitlines()[-1]))
    return {"first_run_s": times[0], "warm_cache_s": statistics.median(times[1:]),
            "warm_cache_runs_s": times[1:]}


def sweep(config: StepConfig, actives: List[int], repeats: int, device: torch.device,
          steps: int) -> Dict[str, Dict[int, float]]:
    """µs per step of each implementation over batch sizes."""
    results: Dict[str, Dict[int, float]] = {name: {} for name in IMPLEMENTATIONS}
    for active in actives:
        sized = replace(config, active=active,
                        max_requests=max(config.max_requests, active + 1))
        inputs = make_steps(sized, steps)
        for name in IMPLEMENTATIONS:
            results[name][active] = measure(name, sized, inputs, repeats, device)["us_per_step"]
    return results


def plot(results: Dict[str, Dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, series in results.items():
        axis.plot(list(series), list(series.values()), marker="o", label=name)
    axis.set_xlabel("active requests")
    axis.set_ylabel("host µs per standard step")
    axis.set_yscale("log")
    axis.set_title("mtpmeta: host cost per step")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _table(config: StepConfig, results: Dict[str, Dict[str, Any]], device: str) -> str:
    reference = results["reference"]["us_per_step"]
    lines = [
        f"mtpmeta bench: standard step on {device} (R={config.max_requests}, "
        f"W={config.block_columns}x{config.block_size}, active={config.active}, "
        f"depths={config.depths}, prefill={config.prefill_tokens}, tp={config.tp})",
        f"{'impl':<10}{'µs/step':>10}{'rows':>8}{'carry':>8}{'depth':>8}{'commit':>9}"
        f"{'speed-up':>10}{'ops/step':>10}{'syncs':>7}{'draft allocs':>14}",
    ]
    for name, row in results.items():
        groups = row["us_per_group"]
        lines.append(
            f"{name:<10}{row['us_per_step']:>10.1f}{groups['rows']:>8.1f}"
            f"{groups['carry']:>8.1f}{groups['draft depth']:>8.1f}"
            f"{groups['commit pass']:>9.1f}{reference / row['us_per_step']:>9.1f}x"
            f"{row['ops_per_step']:>10}{row['syncs_per_step']:>7}"
            f"{row['draft_loop_allocations']:>14}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpmeta bench", description=__doc__.split("\n")[0])
    defaults = StepConfig()
    parser.add_argument("--quick", action="store_true", help="finish in under 30 s")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--device", default="cpu", help="device of the buffers (cpu/cuda)")
    for flag, attr in (("--max-requests", "max_requests"), ("--active", "active"),
                       ("--depths", "depths"), ("--block-size", "block_size"),
                       ("--block-columns", "block_columns"),
                       ("--prefill-tokens", "prefill_tokens"), ("--tp", "tp")):
        parser.add_argument(flag, type=int, default=getattr(defaults, attr), dest=attr)
    parser.add_argument("--steps", type=int, default=8, help="distinct seeded steps")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="host cost over batch sizes")
    parser.add_argument("--plot", metavar="PNG", help="draw the sweep (needs matplotlib)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: OpenMP wake-ups on a "
                             "busy host make CPU timings of both sides noisy)")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="skip the new-process first-step measurement")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    config = StepConfig(max_requests=max(args.max_requests, args.active + 1),
                        active=args.active,
                        depths=args.depths, block_size=args.block_size,
                        block_columns=args.block_columns, prefill_tokens=args.prefill_tokens,
                        tp=args.tp)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    steps = make_steps(config, 4 if args.quick else args.steps, seed=args.seed)
    repeats = args.repeats or (5 if args.quick else 30)
    mismatch = check_identical(config, steps, device)
    if mismatch:
        print(f"mtpmeta bench: RESULTS DIFFER: {mismatch}", file=sys.stderr)
        return 1
    print("views identical across reference, direct and mirror paths "
          f"({len(steps)} steps)")
    progress = _progress(repeats * len(IMPLEMENTATIONS))
    results = {name: measure(name, config, steps, repeats, device, progress)
               for name in IMPLEMENTATIONS}
    if progress is not None:
        progress.close()
    print(_table(config, results, str(device)))
    output: Dict[str, Any] = {"config": asdict(config), "device": str(device),
                              "results": results}
    if device.type == "cpu":
        output["kernel_floor"] = kernel_floor(config, steps, repeats)
        floor_us = output["kernel_floor"]["us_per_step"]
        print(f"kernel floor (direct path's numba kernels alone, inputs pre-converted, no "
              f"validation): {floor_us:.1f} µs/step = "
              f"{results['reference']['us_per_step'] / floor_us:.1f}x the reference")
        if not output["kernel_floor"]["same_result"]:
            print("mtpmeta bench: the kernel floor step differs from the direct path",
                  file=sys.stderr)
            return 1
    if device.type == "cpu" and not args.no_cold_start:
        output["cold_start"] = cold_start(config)
        print("cold start (new process, imports + first step): "
              f"{output['cold_start']['first_run_s']:.2f} s as the numba cache was, "
              f"{output['cold_start']['warm_cache_s']:.2f} s with it warm (median of "
              f"{len(output['cold_start']['warm_cache_runs_s'])})")
    if args.sweep or args.plot:
        actives = [8, 32, 64, 128, 192, 256] if not args.quick else [8, 64, 192]
        output["sweep"] = sweep(config, actives, max(2, repeats // 5), device,
                                2 if args.quick else 4)
        for name, series in output["sweep"].items():
            print(f"sweep {name:<10}" + "  ".join(f"{a}:{us:.0f}µs" for a, us in series.items()))
        if args.plot:
            plot(output["sweep"], args.plot)
            print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(output, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timing", leave=False, disable=not sys.stderr.isatty())
