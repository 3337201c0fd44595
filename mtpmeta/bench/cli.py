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
agreement check are ``variants``, the timing ``measure``, the printed table, targets
and verdict ``report``, the figure ``plots``, the option checks ``usage``. Every option
is checked before any work. Stdout holds the results and ends with a one-line verdict;
each section announces itself on stderr before its work (progress, not results).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch

from mtpmeta.bench.measure import cold_start, load_now, machine_load, measure, sweep
from mtpmeta.bench.report import (LEGEND, TARGETS_NOTE, load_lines, spread_line, table, target_lines,
                     target_summary, verdict_line)
from mtpmeta.bench.usage import (ToolParser, device_problem, missing_module, output_problem, parse,
                    positive_int, usage_error)
from mtpmeta.bench.variants import check_identical, floor_matches, implementations
from mtpmeta.bench.workload import StepConfig, make_steps

__all__ = ["main"]

PROG = "mtpmeta bench"
DESCRIPTION = """\
Per-step host cost of mtpmeta against its pure-torch reference, on the standard step
(mtpmeta/bench/workload.py). It first checks that every path leaves the reference's
view contents and buffers (exit status 1 if not), then times whole steps and each
method group in interleaved passes, counts torch ops, syncs and draft-loop
allocations, and prints a table. Ratios are measured in the same run; absolute times
only compare on the same machine."""
_SIZES = (("--max-requests", "max_requests", "request slots R (must exceed --active: "
           "the prefill request takes one more)"),
          ("--active", "active", "decode requests in the draft loop and the commit pass"),
          ("--depths", "depths", "draft depths per draft loop"),
          ("--block-size", "block_size", "tokens per KV block"),
          ("--block-columns", "block_columns", "block-table columns W"),
          ("--prefill-tokens", "prefill_tokens", "tokens of the commit pass's prefill "
           "chunk"),
          ("--tp", "tp", "tensor-parallel multiple the token counts are padded to"))


def _parser() -> ToolParser:
    parser = ToolParser(prog=PROG, description=DESCRIPTION,
                        epilog=f"{LEGEND}\n\n{TARGETS_NOTE}")
    defaults = StepConfig()
    parser.add_argument("--quick", action="store_true",
                        help="4 steps, 5 passes, 1 warm cold-start run: about 30 s on an idle "
                             "machine")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--device", default="cpu",
                        help="device of the buffers: cpu (the direct and the mirror path) "
                             "or cuda / cuda:N (the mirror path)")
    for flag, attr, what in _SIZES:
        parser.add_argument(flag, type=positive_int, default=getattr(defaults, attr),
                            dest=attr, help=what)
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="distinct seeded steps (default 8; 4 with --quick)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed passes (default 30; 5 with --quick)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the drawn steps and of the pass order")
    parser.add_argument("--sweep", action="store_true",
                        help="also time each path over batch sizes 8-256")
    parser.add_argument("--plot", metavar="PNG",
                        help="draw the sweeps that ran to PNG, median and per-pass "
                             "spread: the width sweep with --width-sweep, the batch "
                             "sweep with --sweep (implied when --width-sweep is not "
                             "given); needs the plot extra, matplotlib")
    parser.add_argument("--targets", action="store_true",
                        help="print each performance target with its figures (without "
                             "it: one line, how many were met)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (1: OpenMP wake-ups on a busy host "
                             "make CPU timings of both sides noisy)")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="skip the new-process first-step measurement (cold, with a "
                             "fresh numba cache, and warm)")
    parser.add_argument("--no-per-call", action="store_true",
                        help="skip the per-call torch-vs-numpy input cost section")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per step under valgrind's "
                             "callgrind (load-independent ratios; about 1-2 minutes; "
                             "needs valgrind and the bench extra)")
    parser.add_argument("--geometry", choices=("standard", "production"),
                        default="standard", help="production: also the production-like "
                        "row (R 1024, N 768, W 2048) with H2D bytes per step")
    parser.add_argument("--trace", action="store_true", help="only the seeded "
                        "continuous-batching trace rows (mtpmeta.bench.trace_bench)")
    parser.add_argument("--width-sweep", action="store_true",
                        help="per-draft-depth cost over W in {128, 512, 2048, 8192}")
    return parser


def _config_problem(args) -> Optional[str]:
    """Why the sizes make no standard step, or None."""
    if args.max_requests <= args.active:
        return (f"--max-requests {args.max_requests} must exceed --active {args.active} "
                f"(the step's prefill request takes one more slot): use at least "
                f"{args.active + 1}")
    defaults = StepConfig()
    table_tokens = args.block_columns * args.block_size
    # make_steps: the prefill starts half a block before its inherited blocks end
    prefill_end = (defaults.inherited_blocks * args.block_size - args.block_size // 2
                   + args.prefill_tokens)
    if args.block_columns < defaults.inherited_blocks or prefill_end > table_tokens:
        return (f"--block-columns {args.block_columns} x --block-size {args.block_size} "
                f"holds {table_tokens} tokens per request, but the step's prefill chunk "
                f"(after {defaults.inherited_blocks} inherited blocks) reaches token "
                f"{prefill_end}: raise --block-columns or lower --prefill-tokens")
    if table_tokens <= args.depths + 4:
        return (f"--depths {args.depths} does not fit a block table of {table_tokens} "
                f"tokens per request")
    return None


def _usage_problem(args) -> Optional[str]:
    """The first option that cannot work, as one line, or None: checked before any
    work, so a bad option costs nothing."""
    from mtpmeta.bench.instructions import unavailable

    problem = device_problem(args.device) or _config_problem(args)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            problem = problem or output_problem(flag, path)
    if args.plot:
        problem = problem or missing_module("matplotlib", "plot", "--plot")
    if args.instructions and problem is None:
        reason = unavailable()
        if reason:
            problem = f"--instructions cannot count here: {reason}"
    return problem


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``mtpmeta bench`` with ``argv``; 0, 1 when a path disagrees with the
    reference (or the kernel floor with the direct path) before any timing, 2 for an
    option that cannot work (one line on stderr, before any work); 0 after --help."""
    args, status = parse(_parser(), argv)
    if args is None:
        return status
    problem = _usage_problem(args)
    if problem:
        return usage_error(PROG, problem)
    if args.trace:
        from mtpmeta.bench.trace_bench import run_trace
        return run_trace(args)
    config = StepConfig(max_requests=args.max_requests, active=args.active,
                        depths=args.depths, block_size=args.block_size,
                        block_columns=args.block_columns, prefill_tokens=args.prefill_tokens,
                        tp=args.tp)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    steps = make_steps(config, args.steps or (4 if args.quick else 8), seed=args.seed)
    repeats = args.repeats or (5 if args.quick else 30)
    names = implementations(device)
    _note(f"checking {', '.join(names)} against each other on {len(steps)} steps")
    mismatch = check_identical(config, steps, device)
    if mismatch:
        print(f"mtpmeta bench: RESULTS DIFFER: {mismatch}", file=sys.stderr)
        return 1
    print(f"views identical across {', '.join(names)} (torch and numpy "
          f"inputs, eager and graphed; {len(steps)} steps)")
    on_cpu = device.type == "cpu"
    if on_cpu and not floor_matches(config, steps):
        print("mtpmeta bench: the kernel floor step differs from the direct path",
              file=sys.stderr)
        return 1
    _note(f"timing {repeats} interleaved passes of every row ({len(steps)} steps each)")
    progress = _progress(repeats)
    load_before = load_now()
    results, floors = measure(config, steps, repeats, device, progress,
                              order_seed=args.seed)
    load = machine_load(load_before)
    if progress is not None:
        progress.close()
    print(table(config, results, str(device), floors))
    print(LEGEND)
    print(spread_line(results))
    for line in load_lines(load) if load else ():
        print(line)
    from mtpmeta.bench.captured import format_captured, measure_captured  # the captured draft loop

    _note("timing the captured draft loop")
    captured = measure_captured(config, steps, repeats, device)
    print(format_captured(captured, config.depths))
    output: Dict[str, Any] = {"config": asdict(config), "device": str(device),
                              "results": results, "load": load, "captured": captured}
    if floors:
        output["kernel_floor"] = {"us_per_step": floors["kernel floor"],
                                  "us_per_step_torch_inputs":
                                      floors["kernel floor, torch inputs"],
                                  "same_result": True}
    input_cost = None
    if on_cpu and not args.no_per_call:
        from mtpmeta.bench.percall import format_input_cost, input_cost as measure_input_cost

        _note("timing torch against numpy inputs per call")
        input_cost = measure_input_cost(config, repeats=5 if args.quick else 9,
                                        number=300 if args.quick else 2000)
        output["input_cost"] = input_cost
        print(format_input_cost(input_cost))
    targets = target_lines(results, floors, input_cost, config.depths)
    output["targets"] = targets
    if targets and args.targets:
        print(TARGETS_NOTE)
        for line in targets:
            print(f"target: {line}")
    elif targets:
        print(target_summary(targets))
    if on_cpu and not args.no_cold_start:
        _note("cold start: a new process with an empty numba cache, then warm")
        cold = output["cold_start"] = cold_start(config, warm_runs=1 if args.quick else 3)
        print(f"cold start (new process, imports + first step): {cold['cold_s']:.2f} s "
              f"with an empty numba cache (compiling {cold['cache_files_written']} cache "
              f"files), {cold['warm_s']:.2f} s with it warm (median of "
              f"{len(cold['warm_runs_s'])}): {cold['compile_s']:.2f} s of compilation")
    if args.instructions:
        from mtpmeta.bench.instructions import count_step_instructions, format_instructions

        _note("counting instructions under callgrind")
        output["instructions"] = count_step_instructions(config, steps=len(steps),
                                                         seed=args.seed)
        print(format_instructions(output["instructions"]))
    from . import extra_sections  # issue 17's rows: per-call ops, fresh shapes, ...
    spreads: Dict[str, Any] = {"width": {}, "sweep": {}}
    output.update(extra_sections.run(args, config, _note, spreads["width"]))
    sweep_passes = max(2, repeats // 5)
    if args.sweep or (args.plot and not args.width_sweep):
        actives = [8, 32, 64, 128, 192, 256] if not args.quick else [8, 64, 192]
        _note(f"batch sweep over {', '.join(map(str, actives))} active requests")
        output["sweep"] = sweep(config, actives, sweep_passes, device,
                                2 if args.quick else 4, spread=spreads["sweep"])
        for name, series in output["sweep"].items():
            print(f"sweep {name:<10}" + "  ".join(f"{a}:{us:.0f}µs" for a, us in series.items()))
    if args.plot:
        _plot(args, output, spreads, sweep_passes, 5 if args.quick else 15)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(output, handle, indent=2)
        print(f"wrote {args.json}")
    print(verdict_line(results, names, len(steps)))
    return 0


def _note(text: str) -> None:
    """Progress on stderr: the section about to run (stdout keeps the results)."""
    print(f"mtpmeta bench: {text} ...", file=sys.stderr, flush=True)


def _plot(args, output: Dict[str, Any], spreads: Dict[str, Any], sweep_passes: int,
          width_passes: int) -> None:
    """The ``--plot`` figure: a panel per sweep that ran, medians with per-pass spread."""
    from mtpmeta.bench.plots import Panel, plot

    panels = []
    if "width_sweep" in output:
        width = output["width_sweep"]
        timed = width["unit"] != "instructions"
        panels.append(Panel(f"one draft depth over the table width (N {width['active']})",
                            "block-table width W (max_kv_block_count)",
                            "µs per depth" if timed else "instructions per depth",
                            width["per_depth"], spreads["width"],
                            passes=width_passes if timed else 1, log_x=True))
    if "sweep" in output:
        panels.append(Panel("host cost per standard step", "active requests",
                            "µs per step", output["sweep"], spreads["sweep"],
                            passes=sweep_passes))
    plot(panels, args.plot)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timing", leave=False, disable=not sys.stderr.isatty())
