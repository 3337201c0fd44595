"""``mtpmeta bench``: per-step host cost of the library against the pure-torch reference.

Runs the standard step (``mtpmeta.bench.workload``) through the paths a device has (CPU:
the direct and the mirror path; CUDA: the mirror path) and the reference, with the
seed's input types (torch tensors) and, for comparison, numpy arrays, each with an
eager and a graphed draft loop. It first checks that every path leaves the reference's
view contents and buffers (exit status 1 if not), then times whole steps and each
method group, interleaved so a load change hits every row alike, counts torch ops,
syncs and draft-loop allocations, and prints a table, the captured draft loop's host
side, the cold start, with ``--targets`` the maintainers' performance targets and, with
``--instructions``, callgrind counts (a measure that does not move with machine load). ``--trace`` runs the seeded
continuous-batching trace instead (``mtpmeta.bench.trace_bench``), ``--plot PATH`` the
width sweep drawn as a PNG (``mtpmeta.bench.width_sweep``).

This module is the command line: its options, their checks (before any work, so a bad
option costs nothing: one line on stderr, exit status 2; the helpers are shared with
``mtpmeta simulate``) and the order of the sections. Stdout holds the results and ends
with a one-line verdict; each section announces itself on stderr before its work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch

from mtpmeta.bench.measure import cold_start, load_now, machine_load, measure, new_view_cost, \
    measure_captured
from mtpmeta.bench.report import LEGEND, PROG, TARGETS_NOTE, format_captured, install_hint, \
    load_lines, note, spread_line, table, target_lines, verdict_line
from mtpmeta.bench.variants import check_identical, floor_matches, implementations
from mtpmeta.bench.workload import StepConfig, make_steps

__all__ = ["main", "note", "HelpFormatter", "ToolParser", "parse", "usage_error",
           "positive_int", "device_problem", "output_problem", "install_hint"]

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
                        epilog=LEGEND)
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
    parser.add_argument("--targets", action="store_true",
                        help="also print the maintainers' performance targets, each "
                             "with this run's figures and met or MISSED")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (1: OpenMP wake-ups on a busy host "
                             "make CPU timings of both sides noisy)")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="skip the new-process first-step measurement (cold, with a "
                             "fresh numba cache, and warm)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per step under valgrind's "
                             "callgrind (load-independent ratios; about 1-2 minutes; "
                             "needs valgrind and the bench extra)")
    parser.add_argument("--trace", action="store_true",
                        help="instead of the standard step: replay the seeded "
                        "continuous-batching traces (standard R 256 W 128, production "
                        "R 1024 W 2048 and W 8192) through every path, checked against "
                        "the reference, then timed on the meta device (the host's share "
                        "of a GPU step); a few minutes (about 4 on a 2-CPU machine), "
                        "--quick about one")
    parser.add_argument("--plot", metavar="PATH",
                        help="instead of the standard step: time the standard trace's "
                        "traffic on block tables 128, 512, 2048 and 8192 columns wide "
                        "(checked against the reference first) and draw host µs per "
                        "step against W, for the default call, block counts and the "
                        "reference, as a PNG at PATH (needs matplotlib: pip install "
                        "'mtpmeta[plot]')")
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
    if args.json is not None:
        problem = problem or output_problem("--json", args.json)
    if args.trace and (args.instructions or args.device != "cpu"):
        problem = problem or ("--trace times the meta device and the CPU; --device and "
                              "--instructions apply to the standard step only")
    if args.plot is not None and problem is None:
        from mtpmeta.bench.width_sweep import matplotlib_problem

        if args.trace or args.instructions or args.device != "cpu":
            problem = ("--plot times the meta device on its own; --trace, --device and "
                       "--instructions do not combine with it")
        problem = (problem or output_problem("--plot", args.plot)
                   or matplotlib_problem())
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
    if args.plot is not None:
        from mtpmeta.bench.width_sweep import run_plot
        return run_plot(args)
    config = StepConfig(max_requests=args.max_requests, active=args.active,
                        depths=args.depths, block_size=args.block_size,
                        block_columns=args.block_columns, prefill_tokens=args.prefill_tokens,
                        tp=args.tp)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    steps = make_steps(config, args.steps or (4 if args.quick else 8), seed=args.seed)
    repeats = args.repeats or (5 if args.quick else 30)
    names = implementations(device)
    note(f"checking {', '.join(names)} against each other on {len(steps)} steps")
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
    note(f"timing {repeats} interleaved passes of every row ({len(steps)} steps each)")
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
    note("timing the captured draft loop")
    captured = measure_captured(config, steps, repeats, device)
    print(format_captured(captured, config.depths))
    output: Dict[str, Any] = {"config": asdict(config), "device": str(device),
                              "results": results, "load": load, "captured": captured}
    if floors:
        output["kernel_floor"] = {"us_per_step": floors["kernel floor"],
                                  "us_per_step_torch_inputs":
                                      floors["kernel floor, torch inputs"],
                                  "same_result": True}
    if args.targets:
        targets = output["targets"] = target_lines(results, floors, config.depths)
        print(TARGETS_NOTE)
        for line in targets:
            print(f"target: {line}")
    if on_cpu and not args.no_cold_start:
        note("cold start: a new process with an empty numba cache, then warm")
        cold = output["cold_start"] = cold_start(config, warm_runs=1 if args.quick else 3)
        print(f"cold start (new process, imports + first step): {cold['cold_s']:.2f} s "
              f"with an empty numba cache (compiling {cold['cache_files_written']} cache "
              f"files), {cold['warm_s']:.2f} s with it warm (median of "
              f"{len(cold['warm_runs_s'])}): {cold['compile_s']:.2f} s of compilation")
    if on_cpu:
        note("new view: its first commit pass and draft depth, the kernels warm")
        views = output["new_view"] = new_view_cost(config, steps)
        print("new view (mirror path, CPU, kernels warm): first commit pass "
              f"{views['commit_pass_first_ms']:.2f} ms, warm "
              f"{views['commit_pass_warm_ms']:.2f} ms; first draft depth "
              f"{views['draft_depth_first_ms']:.2f} ms, warm "
              f"{views['draft_depth_warm_ms']:.2f} ms")
    if args.instructions:
        from mtpmeta.bench.instructions import count_step_instructions, format_instructions

        note("counting instructions under callgrind")
        output["instructions"] = count_step_instructions(config, steps=len(steps),
                                                         seed=args.seed)
        print(format_instructions(output["instructions"]))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(output, handle, indent=2)
        print(f"wrote {args.json}")
    print(verdict_line(results, names, len(steps)))
    return 0


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timing", leave=False, disable=not sys.stderr.isatty())


# Option handling shared by the ``mtpmeta`` commands: one-line usage errors with exit
# status 2, help that shows every default, install advice that fits the installation.


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks and appends ``(default: X)``
    to every option whose default is a value (not None, not an off switch) and whose
    help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS
                or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


class ToolParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse(parser: argparse.ArgumentParser, argv: Optional[List[str]]
          ) -> Tuple[Optional[argparse.Namespace], int]:
    """``(args, 0)``, or ``(None, status)`` once ``--help`` (0) or a malformed option
    (2, its one line already printed) ended the parse: a command's ``main`` returns
    that status instead of raising SystemExit."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as exit_:
        return None, exit_.code if isinstance(exit_.code, int) else 2


def usage_error(prog: str, message: str) -> int:
    """Print ``prog: message`` to stderr as one line; return exit status 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def device_problem(text: str) -> Optional[str]:
    """Why ``--device text`` cannot run here (not a torch device, not cpu/cuda, no
    CUDA, no such GPU), or None."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return f"--device {text!r} is not a device; use cpu or cuda (cuda:N for GPU N)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {text}: only cpu and cuda are supported"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {text}, but CUDA is not available (torch {torch.__version__})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"--device {text}, but this machine has "
                    f"{torch.cuda.device_count()} CUDA device(s)")
    return None


def output_problem(flag: str, path: str) -> Optional[str]:
    """Why ``path`` (for ``flag``) cannot be written once the run is over, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path} is a directory; give a file name"
    if not os.path.isdir(folder):
        return f"{flag} {path}: the directory {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{flag} {path}: the directory {folder} is not writable"
    return None
