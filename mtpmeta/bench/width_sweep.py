"""``mtpmeta bench --plot PATH``: host µs per step against the block table's width.

The standard trace's traffic (``mtpmeta.bench.trace``, R 256) is replayed with block
tables ``WIDTHS`` wide: the requests use the same blocks at every width, only the
tables grow. Per width the mirror path (the default call) and the mirror path given
each row's block count (``block_counts=``, contract §5) are first checked against the
reference on the CPU (exit status 1 if one differs), then timed beside the reference on
torch's ``meta`` device (``trace_bench.measure_trace``: the host's share of a GPU step).
The figure shows the three lines on a log-scaled width axis; it needs matplotlib, the
``plot`` extra (``pip install 'mtpmeta[plot]'``), which the option checks before any
work.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Sequence

from mtpmeta.bench.report import speed
from mtpmeta.bench.trace import STANDARD_TRACE, TraceConfig, make_trace

__all__ = ["WIDTHS", "LINES", "matplotlib_problem", "sweep_config", "measure_sweep",
           "format_sweep", "write_plot", "run_plot"]

#: The table widths W of the sweep, 128 to 8192 columns.
WIDTHS = (128, 512, 2048, 8192)
#: The lines of the figure: ``(label, trace row key)``.
LINES = (("default call (mirror path)", "mirror @meta"),
         ("block counts", "mirror, block counts @meta"),
         ("reference (upstream's op sequence)", "reference @meta"))
#: Steps of the agreement check per width: the first steps exercise every call.
CHECK_STEPS = 4


def matplotlib_problem() -> Optional[str]:
    """Why ``--plot`` cannot draw here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from mtpmeta.bench.report import install_hint

        hint = install_hint("plot")
        where = "" if hint.startswith("pip install 'mtpmeta") else \
            f" (from this source checkout: {hint})"
        return (f"--plot needs matplotlib, which is not installed: pip install "
                f"'mtpmeta[plot]'{where}")
    return None


def sweep_config(width: int) -> TraceConfig:
    """The standard trace's traffic on a table ``width`` columns wide."""
    return replace(STANDARD_TRACE, block_columns=width,
                   pool_columns=STANDARD_TRACE.block_columns)


def measure_sweep(widths: Sequence[int], steps: int, repeats: int, seed: int = 0,
                  note: Callable[[str], None] = lambda text: None
                  ) -> Optional[Dict[int, Dict[str, Any]]]:
    """``{W: measure_trace result}`` per width, each width checked first; None (after
    printing the difference on stderr) when a path differs from the reference."""
    from mtpmeta.bench import trace_replay
    from mtpmeta.bench.trace_bench import TraceRow, measure_trace

    rows = (TraceRow("reference", "reference"), TraceRow("mirror", "mirror"),
            TraceRow("mirror, block counts", "mirror", block_counts=True))
    out: Dict[int, Dict[str, Any]] = {}
    for width in widths:
        config = sweep_config(width)
        note(f"W {width}: checking mirror (and with block counts) against the reference "
             f"on {min(steps, CHECK_STEPS)} steps")
        mismatch = trace_replay.check_trace(
            config, make_trace(config, min(steps, CHECK_STEPS), seed=seed),
            paths=("mirror",), counts=("mirror",), device_inputs=False)
        if mismatch:
            print(f"mtpmeta bench: RESULTS DIFFER (W {width}): {mismatch}",
                  file=sys.stderr, flush=True)
            return None
        note(f"W {width}: timing {len(rows)} rows over {steps} steps")
        out[width] = measure_trace(config, steps, repeats=repeats, seed=seed, rows=rows)
    return out


def format_sweep(sweep: Dict[int, Dict[str, Any]]) -> str:
    """The sweep as a table: µs per step of each line at each width."""
    lines = [f"width sweep, standard trace traffic (R {STANDARD_TRACE.max_requests}), "
             "host µs per step on meta (median over steps):",
             f"  {'W':>6}" + "".join(f"{label.split(' (')[0]:>22}" for label, _ in LINES)
             + f"{'counts vs ref':>16}"]
    for width, result in sweep.items():
        rows = result["rows"]
        counted = rows["mirror, block counts @meta"]["speedup_vs_reference"]
        lines.append(f"  {width:>6}" + "".join(f"{rows[key]['median_us']:>22,.0f}"
                                                for _, key in LINES)
                     + f"{speed(counted):>16}")
    return "\n".join(lines)


def write_plot(sweep: Dict[int, Dict[str, Any]], path: str) -> None:
    """Draw the sweep (µs per step against W, one line per ``LINES``) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot

    widths = list(sweep)
    figure, axes = pyplot.subplots(figsize=(7, 4.5), dpi=100)
    for (label, key), style in zip(LINES, ("o-", "s-", "^--")):
        axes.plot(widths, [sweep[w]["rows"][key]["median_us"] for w in widths], style,
                  label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(widths, [str(w) for w in widths])
    axes.set_xlabel("block-table width W (columns)")
    axes.set_ylabel("host µs per step (meta device)")
    axes.set_title(f"Host cost per step against table width, standard trace traffic "
                   f"(R {STANDARD_TRACE.max_requests})", fontsize=10)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot.close(figure)


def run_plot(args: Any) -> int:
    """``mtpmeta bench --plot PATH``: check, time, print the table, write the PNG;
    1 when a path differs from the reference, else 0 after the verdict."""
    import json

    from mtpmeta.bench.measure import load_now, machine_load
    from mtpmeta.bench.report import load_lines, note

    steps = args.steps or (6 if args.quick else 12)
    repeats = args.repeats or (2 if args.quick else 3)
    note(f"width sweep: W {', '.join(map(str, WIDTHS))}, each checked against the "
         f"reference on the CPU, then timed in {repeats} interleaved passes")
    before = load_now()
    sweep = measure_sweep(WIDTHS, steps, repeats, args.seed,
                          note=lambda text: note(f"width sweep: {text}"))
    if sweep is None:
        return 1
    load = machine_load(before)
    print(format_sweep(sweep), flush=True)
    for line in load_lines(load, "p90 against the median", None) if load else ():
        print(line, flush=True)
    write_plot(sweep, args.plot)
    print(f"wrote {args.plot}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"width_sweep": {str(w): r for w, r in sweep.items()}, "load": load},
                      handle, indent=2, default=str)
        print(f"wrote {args.json}", flush=True)
    first, last = WIDTHS[0], WIDTHS[-1]
    growth = {label: sweep[last]["rows"][key]["median_us"]
              / sweep[first]["rows"][key]["median_us"] for label, key in LINES[:2]}
    print(f"verdict: the mirror path, with and without block counts, left the "
          f"reference's views and buffers at every width (W {first} to {last}); µs per "
          f"step at W {last} over W {first}: "
          + ", ".join(f"{label} {ratio:.2f}x" for label, ratio in growth.items()),
          flush=True)
    return 0
