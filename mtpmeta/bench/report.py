"""What ``mtpmeta bench`` prints: the results table, the captured loop's host side, the
verdict, and with ``--targets`` the maintainers' performance targets.

Inputs are :func:`mtpmeta.bench.measure.measure`'s results (keyed by variant label)
and kernel floors (µs per step); every speed-up is against the reference of the same
draft mode, measured in the same run.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from mtpmeta.bench.variants import DRAFT_MODES, Variant
from mtpmeta.bench.workload import StepConfig

PROG = "mtpmeta bench"

__all__ = ["TARGETS", "LEGEND", "TARGETS_NOTE", "speed", "versus", "table", "format_captured",
           "target_lines", "spread_line", "load_lines", "verdict_line"]

#: The performance targets ``--targets`` checks (maintainers' goals):
#: ``direct_vs_floor``: the direct path's wrappers (validation, mode bookkeeping,
#: shapes) cost at most this multiple of its bare kernels; ``direct_speedup``: on the
#: CPU the direct path is at least this many times faster than upstream's op sequence;
#: ``mirror_ops``: a standard step on the mirror path launches at most this many device
#: data ops (plus one per draft advance) and never syncs, so a GPU step's host cost is
#: a fixed handful of launches.
TARGETS = {"direct_vs_floor": 1.35, "direct_speedup": 15.0,
           "mirror_ops": 16}  # data ops per standard step, plus one per draft advance

#: What the table's columns hold; printed under it and in ``mtpmeta bench --help``.
LEGEND = """\
columns: µs/step = median wall time of one standard step over the interleaved passes;
  rows, carry, depth, commit = µs of that step in the row moves/swaps/resets, the chunk
  carry and take, ONE draft depth (setup + advance), the commit pass;
  speed-up = the reference's µs/step (same draft mode, same run) over this row's
  (below 1 it reads "N.Nx slower": the reference is N.N times faster);
  ops = torch ops dispatched per step (counts, not times); data ops = those that read
  or write tensor data (the rest are views, which launch nothing on a GPU);
  syncs = reads of a tensor's value back to the host (.item() and the like: a device
  sync each on a GPU); draft allocs = new tensor storages in the draft loop (must be 0)."""

#: What ``--targets`` prints above the ``target:`` lines: the maintainers' performance
#: goals, which the default output leaves out.
TARGETS_NOTE = """\
targets (maintainers' performance goals): the direct path within 1.35x of its bare
  kernels and 15x faster than upstream's op sequence on the CPU; the mirror path at
  most 16 device data ops per standard step plus one per draft advance, and no sync.
  MISSED means slower, or more torch ops, than the goal, not wrong results: every path
  was checked against the reference first, and a miss leaves the exit status 0."""


def speed(ratio: float, digits: int = 2) -> str:
    """A speed-up as a reader takes it: ``3.20x`` at or above 1, and below 1 the slow-down
    it is, ``1.37x slower`` (0.73 of the baseline's speed). Every ratio of the bench's
    tables and verdicts reads through here."""
    if ratio >= 1 or ratio <= 0:
        return f"{ratio:.{digits}f}x"
    return f"{1 / ratio:.{digits}f}x slower"


def versus(ratio: float, baseline: str = "the reference", digits: int = 2) -> str:
    """``speed`` in a sentence: ``3.20x faster than the reference``, ``1.37x slower
    than the reference``."""
    text = speed(ratio, digits)
    return f"{text} than {baseline}" if text.endswith("slower") else \
        f"{text} faster than {baseline}"


def _reference_us(results: Dict[str, Dict[str, Any]], draft: str) -> float:
    return results[Variant("reference", "torch", draft).label]["us_per_step"]


def table(config: StepConfig, results: Dict[str, Dict[str, Any]], device: str,
          floors: Dict[str, float]) -> str:
    """One line per variant (µs per step and per method group, speed-up, counts), then
    the kernel floors."""
    lines = [
        f"mtpmeta bench: standard step on {device} (R={config.max_requests}, "
        f"W={config.block_columns}x{config.block_size}, active={config.active}, "
        f"depths={config.depths}, prefill={config.prefill_tokens}, tp={config.tp})",
        f"{'impl':<10}{'inputs':<7}{'draft':<8}{'µs/step':>9}{'rows':>7}{'carry':>7}"
        f"{'depth':>7}{'commit':>8}{'speed-up':>14}{'ops':>6}{'data ops':>9}{'syncs':>6}"
        f"{'draft allocs':>13}",
    ]
    for label, row in results.items():
        groups = row["us_per_group"]
        speedup = _reference_us(results, row["draft"]) / row["us_per_step"]
        lines.append(
            f"{row['impl']:<10}{row['inputs']:<7}{row['draft']:<8}{row['us_per_step']:>9.1f}"
            f"{groups['rows']:>7.1f}{groups['carry']:>7.1f}{groups['draft depth']:>7.1f}"
            f"{groups['commit pass']:>8.1f}{speed(speedup, 1):>14}{row['ops_per_step']:>6}"
            f"{row['data_ops_per_step']:>9}{row['syncs_per_step']:>6}"
            f"{row['draft_loop_allocations']:>13}")
    stalls = [f"{label} {row['fence_stalls_per_step']:.2f}" for label, row in results.items()
              if row.get("fence_stalls_per_step") is not None]
    if stalls:
        lines.append("fence stalls/step (host waits on its own staging): " + ", ".join(stalls))
    for label, inputs, what in (
            ("kernel floor", "numpy", "the direct path's numba kernels alone, inputs "
             "pre-converted"),
            ("kernel floor, torch inputs", "torch", "the same plus one Tensor.numpy() per "
             "torch input")):
        if label in floors:
            ratio = _reference_us(results, 'eager') / floors[label]
            lines.append(f"{'floor':<10}{inputs:<7}{'':<8}{floors[label]:>9.1f}{'':>29}"
                         f"{speed(ratio, 1):>14}   ({what})")
    return "\n".join(lines)


def format_captured(result: Dict[str, Dict[str, Any]], depths: int) -> str:
    """The captured draft loop's host side (``measure.measure_captured``), one line per
    path, with what it excludes."""
    lines = [f"captured draft loop (capture_setup=True), host side of a {depths}-depth "
             "loop; the graph replays are excluded (device work the caller launches):"]
    for name, row in result.items():
        lines.append(
            f"  {name:<8} {row['captured_host_us_per_step']:>8.1f} µs/step, "
            f"{row['captured_host_data_ops']} data ops, {row['captured_host_syncs']} syncs, "
            f"{row['captured_host_allocations']} allocs   (default graphed loop: "
            f"{row['default_graphed_us_per_step']:.1f} µs, "
            f"{row['default_graphed_data_ops']} data ops)   in the graph per depth: "
            f"{row['graph_ops_setup']} setup + {row['graph_ops_advance']} advance ops")
    return "\n".join(lines)


def target_lines(results: Dict[str, Dict[str, Any]], floors: Dict[str, float],
                 depths: int = 0) -> List[str]:
    """Each target (``TARGETS``) against this run's numbers, one line each (``depths``:
    the step's draft depths, whose advances the mirror op budget allows on top)."""
    lines = []
    floor_us = floors.get("kernel floor")
    torch_floor_us = floors.get("kernel floor, torch inputs")
    for draft in DRAFT_MODES:
        direct = results.get(Variant("direct", "torch", draft).label)
        if direct is not None and floor_us is not None:
            vs_floor = direct["us_per_step"] / floor_us
            speedup = _reference_us(results, draft) / direct["us_per_step"]
            ok = vs_floor <= TARGETS["direct_vs_floor"] and \
                speedup >= TARGETS["direct_speedup"]
            extra = "" if torch_floor_us is None else (
                f"; {direct['us_per_step'] / torch_floor_us:.2f}x the floor with "
                "torch inputs")
            lines.append(f"direct, torch inputs, {draft}: {vs_floor:.2f}x the kernel floor "
                         f"(target <= {TARGETS['direct_vs_floor']}){extra}; {speedup:.1f}x "
                         f"the reference (target >= {TARGETS['direct_speedup']:.0f}): "
                         f"{'met' if ok else 'MISSED'}")
        mirror = results.get(Variant("mirror", "torch", draft).label)
        if mirror is not None:
            budget = TARGETS["mirror_ops"] + depths
            ok = mirror["data_ops_per_step"] <= budget and mirror["syncs_per_step"] == 0
            lines.append(f"mirror, torch inputs, {draft}: {mirror['ops_per_step']} torch "
                         f"ops/step, {mirror['data_ops_per_step']} of them touching data "
                         f"(target <= {TARGETS['mirror_ops']} + {depths} advances), "
                         f"{mirror['syncs_per_step']} syncs (target 0): "
                         f"{'met' if ok else 'MISSED'}")
    return lines


def spread_line(results: Dict[str, Dict[str, Any]]) -> str:
    """The speed-up of each library row over its reference, per interleaved pass: the
    lowest and highest pass (both rows of a pass share the machine's load of the
    moment, so this is the ratio's own noise)."""
    parts = []
    for label, row in results.items():
        if row["impl"] == "reference":
            continue
        ref = results[Variant("reference", "torch", row["draft"]).label]["us_by_pass"]
        ratios = [r / us for r, us in zip(ref, row["us_by_pass"])]
        low, high = speed(min(ratios), 1), speed(max(ratios), 1)
        parts.append(f"{row['impl']} {row['inputs']} {row['draft']} "
                     + (low if low == high else f"{low} to {high}"))
    passes = len(next(iter(results.values()))["us_by_pass"])
    return textwrap.fill(f"speed-up per pass, lowest to highest of {passes}: "
                         + ", ".join(parts), width=88, subsequent_indent="  ")


def load_lines(load: Dict[str, Any], swing: str = "see the per-pass spread",
               steady: Optional[str] = "--instructions counts") -> List[str]:
    """The load average before and after the timing, and a warning when the machine
    was busy (``load["busy"]``; ``measure.machine_load``): ``swing`` says where the
    output shows the noise, ``steady`` which of its figures load does not move (None:
    none does)."""
    lines = [f"load average (1 min) {load['before']:.2f} before timing, "
             f"{load['after']:.2f} after, on {load['cpus']} CPUs"]
    if load["busy"]:
        steadier = f", or compare {steady}, which do not move with load" if steady else ""
        lines.append(textwrap.fill(
            "WARNING: the machine is busy: other processes compete for the CPUs, so "
            f"every time above reads high and the ratios swing ({swing}); rerun on an "
            f"idle machine{steadier}", width=88, subsequent_indent="  "))
    return lines


def verdict_line(results: Dict[str, Dict[str, Any]], names: Sequence[str],
                 steps: int) -> str:
    """The run in one line: which paths were checked against the reference, and each
    path's speed against the reference's host time per step (torch inputs, eager)."""
    paths = [name for name in names if name != "reference"]
    reference = _reference_us(results, "eager")
    ratios = []
    for name in paths:
        us = results[Variant(name, "torch", "eager").label]["us_per_step"]
        ratios.append(f"{name} {versus(reference / us, digits=1)}")
    return (f"verdict: {' and '.join(paths)} wrote the reference's views and buffers on "
            f"all {steps} checked steps (torch and numpy inputs, eager and graphed); "
            f"host time per step, torch inputs, eager: {', '.join(ratios)}")


def note(text: str) -> None:
    """Progress on stderr: the section about to run (stdout keeps the results)."""
    print(f"{PROG}: {text} ...", file=sys.stderr, flush=True)


def install_hint(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra``: an editable
    install of the source checkout this package runs from, else the published
    package's extra."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "mtpmeta" / "__init__.py").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'mtpmeta[{extra}]'"
