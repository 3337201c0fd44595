"""``mtpmeta bench``: per-step host cost of the library against the pure-torch reference.

Runs the standard step (``mtpmeta.bench.workload``) through the paths a device has (CPU: the
direct and the mirror path; CUDA: the mirror path) and the reference, with the seed's
input types (torch tensors) and, for comparison, numpy arrays, each with an eager and
a graphed draft loop. It first checks that every path leaves the reference's view
contents and buffers (exit status 1 if not), then times whole steps and each method
group, interleaved so a load change hits every row alike, counts torch ops, syncs and
draft-loop allocations, and prints a table. Ratios are measured in the same run, side
by side; absolute times only compare on the same machine.

On the CPU it also times the kernel floor (``mtpmeta.bench.floor``), the per-call cost of
torch against numpy inputs (``mtpmeta.bench.percall``) and, with ``--instructions``, counts
instructions per step under callgrind (``mtpmeta.bench.instructions``), a measure that does
not move with machine load.

This module is the command line and the order of the sections; the rows and their
agreement check are ``bench_variants``, the timing ``bench_measure``, the printed table
and targets ``bench_report``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch

from .measure import cold_start, measure, sweep
from .report import plot, table, target_lines
from .variants import check_identical, floor_matches, implementations
from .workload import StepConfig, make_steps

__all__ = ["main"]


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
    parser.add_argument("--steps", type=int, default=None,
                        help="distinct seeded steps (default 8; 4 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="host cost over batch sizes")
    parser.add_argument("--plot", metavar="PNG", help="draw the sweep (needs matplotlib)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: OpenMP wake-ups on a "
                             "busy host make CPU timings of both sides noisy)")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="skip the new-process first-step measurement")
    parser.add_argument("--no-per-call", action="store_true",
                        help="skip the per-call torch-vs-numpy input cost section")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per step under valgrind's "
                             "callgrind (load-independent ratios; about 1-2 minutes)")
    parser.add_argument("--geometry", choices=("standard", "production"),
                        default="standard", help="production: also the production-like "
                        "row (R 1024, N 768, W 2048) with H2D bytes per step")
    parser.add_argument("--width-sweep", action="store_true",
                        help="per-draft-depth cost over W in {128, 512, 2048, 8192}")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``mtpmeta bench`` with ``argv``; 0, or 1 when a path disagrees with the
    reference (or the kernel floor with the direct path) before any timing."""
    args = _parser().parse_args(argv)
    config = StepConfig(max_requests=max(args.max_requests, args.active + 1),
                        active=args.active,
                        depths=args.depths, block_size=args.block_size,
                        block_columns=args.block_columns, prefill_tokens=args.prefill_tokens,
                        tp=args.tp)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    steps = make_steps(config, args.steps or (4 if args.quick else 8), seed=args.seed)
    repeats = args.repeats or (5 if args.quick else 30)
    mismatch = check_identical(config, steps, device)
    if mismatch:
        print(f"mtpmeta bench: RESULTS DIFFER: {mismatch}", file=sys.stderr)
        return 1
    print(f"views identical across {', '.join(implementations(device))} (torch and numpy "
          f"inputs, eager and graphed; {len(steps)} steps)")
    on_cpu = device.type == "cpu"
    if on_cpu and not floor_matches(config, steps):
        print("mtpmeta bench: the kernel floor step differs from the direct path",
              file=sys.stderr)
        return 1
    progress = _progress(repeats)
    results, floors = measure(config, steps, repeats, device, progress)
    if progress is not None:
        progress.close()
    print(table(config, results, str(device), floors))
    output: Dict[str, Any] = {"config": asdict(config), "device": str(device),
                              "results": results}
    if floors:
        output["kernel_floor"] = {"us_per_step": floors["kernel floor"],
                                  "us_per_step_torch_inputs":
                                      floors["kernel floor, torch inputs"],
                                  "same_result": True}
    input_cost = None
    if on_cpu and not args.no_per_call:
        from .percall import format_input_cost, input_cost as measure_input_cost

        input_cost = measure_input_cost(config, repeats=5 if args.quick else 9,
                                        number=300 if args.quick else 2000)
        output["input_cost"] = input_cost
        print(format_input_cost(input_cost))
    targets = target_lines(results, floors, input_cost)
    output["targets"] = targets
    for line in targets:
        print(f"target: {line}")
    if on_cpu and not args.no_cold_start:
        output["cold_start"] = cold_start(config, warm_runs=1 if args.quick else 3)
        print("cold start (new process, imports + first step): "
              f"{output['cold_start']['first_run_s']:.2f} s as the numba cache was, "
              f"{output['cold_start']['warm_cache_s']:.2f} s with it warm (median of "
              f"{len(output['cold_start']['warm_cache_runs_s'])})")
    if args.instructions:
        from .instructions import count_step_instructions, format_instructions

        output["instructions"] = count_step_instructions(config, steps=len(steps),
                                                         seed=args.seed)
        print(format_instructions(output["instructions"]))
    from . import extra_sections  # issue 17's rows: per-call ops, fresh shapes, ...
    output.update(extra_sections.run(args, config))
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
