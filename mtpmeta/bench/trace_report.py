"""What ``mtpmeta bench --trace`` prints: each geometry's check line and table, the
engine-placement counts beside upstream's, the capacity line, the verdict, and with
``--targets`` the maintainers' trace targets.

Inputs are :func:`mtpmeta.bench.trace_bench.measure_trace`'s results by geometry name;
every ratio is against the row's reference in the same run, and reads through
``report.speed`` (below 1: "slower").
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mtpmeta.bench.report import speed, versus

__all__ = ["ENGINE_KEY", "ENGINE_REFERENCE_KEY", "ENGINE_BYTE_EXACT_KEY", "MEGATRON_KEY",
           "checked_line", "width_growth", "growth_text", "format_trace", "engine_line",
           "verdict_line", "pass_spread", "TRACE_TARGETS_NOTE", "trace_target_lines"]

#: The row of the engine's steps through the helpers ``megatron.patch()`` installs.
MEGATRON_KEY = "megatron, patched helpers @meta"
#: The headline: Megatron's client placement through the helpers ``patch()`` installs
#: (its default), upstream's helpers on the same placement (its reference), and the
#: helpers of ``patch(block_counts=False)``, which keep upstream's bytes.
ENGINE_KEY = "megatron, engine placement @meta"
ENGINE_REFERENCE_KEY = "reference, engine placement @meta"
ENGINE_BYTE_EXACT_KEY = "megatron, engine placement, byte-exact @meta"

Growth = Tuple[Dict[str, float], int, int]


def checked_line(name: str, steps: int, arguments: Dict[str, Any]) -> str:
    """The line that says which paths a geometry's check replayed, on how many steps."""
    paths = ", ".join(arguments["paths"])
    extras = [f"{', '.join(arguments['counts'])} with block counts"] \
        if arguments["counts"] else []
    if arguments["device_inputs"]:
        extras.append("mirror with device inputs")
    more = f" (and {'; '.join(extras)})" if extras else ""
    return (f"{name} trace: {paths}{more} leave the reference's view and buffers on all "
            f"{steps} checked steps (CPU)")


def width_growth(out: Dict[str, Any]) -> Optional[Growth]:
    """``({label: growth}, W, wide W)``: each meta row's µs on the wide production
    table over the production one (the same traffic), when both geometries ran."""
    if "production" not in out or "production W 8192" not in out:
        return None
    narrow, wide = out["production"], out["production W 8192"]
    growth = {row["label"]: row["median_us"] / narrow["rows"][key]["median_us"]
              for key, row in wide["rows"].items()
              if row["device"] == "meta" and row["path"] != "reference"
              and key in narrow["rows"]}
    return growth, narrow["geometry"]["W"], wide["geometry"]["W"]


def growth_text(growth: Growth) -> str:
    ratios, narrow, wide = growth
    return (f"µs per step at W {wide} over W {narrow} on the same traffic: "
            + ", ".join(f"{label} {ratio:.2f}x" for label, ratio in ratios.items()))


def _row_line(row: Dict[str, Any]) -> str:
    calls = row["runtime_calls"]
    events = f"{calls['total']:.1f}" if calls else "-"
    ops = row["device_data_ops"] if row["device"] != "cpu" else row["data_ops"]
    estimate = (f"{row['launch_estimate_us']:,.0f} "
                f"({speed(row['launch_speedup_vs_reference'])})"
                if "launch_estimate_us" in row else "-")
    return (f"  {row['label']:<40}{row['device']:<5}{row['median_us']:>8,.0f} "
            f"{row['p90_us']:>8,.0f} {speed(row['speedup_vs_reference']):>13}  "
            f"{estimate:>22}{ops:>8.1f}{row['syncs']:>7.2f}{row.get('d2h_bytes', 0):>11,.0f}"
            f"{events:>8}")


def format_trace(name: str, result: Dict[str, Any]) -> str:
    """The trace table of one geometry, then its engine-placement line."""
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
        f"  {'path':<40}{'dev':<5}{'median':>8} {'p90':>8} {'vs ref':>13}  "
        f"{'+4µs/op est.':>22}{'ops':>8}{'syncs':>7}{'D2H B':>11}{'ev/str':>8}"
        f"   (µs per step)"]
    lines += [_row_line(row) for row in result["rows"].values()]
    lines.append("  vs ref: the reference's µs over the row's (below 1: 'slower'), same "
                 "device (and inputs; the "
                 "engine-placement rows: upstream's helpers on that placement); ops: device "
                 "data ops per step (meta rows; CPU rows: all data ops); syncs: read-backs "
                 "per step, answered from the host on meta; D2H B: bytes they read back; "
                 "ev/str: CUDA event and stream calls per step (mirror path); every step "
                 "timed inside torch.inference_mode(), as Megatron's controller steps the "
                 "helpers, and counted outside it")
    engine = engine_line(result["rows"])
    if engine:
        lines.append(engine)
    return "\n".join(lines)


def _counts_text(row: Dict[str, Any]) -> str:
    return (f"{row['syncs']:.2f} syncs, {row['d2h_bytes']:,.0f} B read back, "
            f"{row['device_data_ops']:.1f} device data ops")


def engine_line(rows: Dict[str, Any]) -> str:
    """Megatron's client placement per step: the patched helpers' syncs, bytes read
    back and device data ops beside upstream's helpers' ('' without those rows)."""
    if ENGINE_KEY not in rows or ENGINE_REFERENCE_KEY not in rows:
        return ""
    parts = [f"patch()'s helpers {_counts_text(rows[ENGINE_KEY])}"]
    if ENGINE_BYTE_EXACT_KEY in rows:
        parts.append(f"byte-exact {_counts_text(rows[ENGINE_BYTE_EXACT_KEY])}")
    parts.append(f"upstream's helpers {_counts_text(rows[ENGINE_REFERENCE_KEY])}")
    return "  Megatron's client placement, per step: " + "; ".join(parts)


def pass_spread(row: Dict[str, Any]) -> str:
    """``"passes 2.90x-3.50x"``: the lowest and highest of the row's ratios pass by
    pass (each pass's median step, the reference's pass of the same round over the
    row's; plain ratios, below 1 included), how far one pass moves with the host's
    state; "" with fewer than 2."""
    ratios = row.get("pass_speedups") or []
    if len(ratios) < 2:
        return ""
    return f"passes {min(ratios):.2f}x-{max(ratios):.2f}x"


def verdict_line(out: Dict[str, Any], checked: Dict[str, int],
                 growth: Optional[Growth] = None) -> str:
    """The run in one line: the traces checked, and per geometry the engine placement
    against upstream's helpers (with both sides' syncs), the reference's µs over the
    mirror path's, the captured loop's and the fastest row's on meta, and the patched
    engine helpers' speed against the mirror path's (``MEGATRON_KEY``)."""
    parts = []
    for name, result in out.items():
        rows = {key: row for key, row in result["rows"].items()
                if row["device"] == "meta" and row["path"] not in ("reference",
                                                                    "upstream engine")}
        shown = []
        if ENGINE_KEY in rows and ENGINE_REFERENCE_KEY in result["rows"]:
            engine, upstream = rows[ENGINE_KEY], result["rows"][ENGINE_REFERENCE_KEY]
            spread = pass_spread(engine)
            shown.append(f"{engine['label']} {speed(engine['speedup_vs_reference'])} "
                         f"({spread + '; ' if spread else ''}{engine['syncs']:.2f} syncs "
                         f"per step against upstream's {upstream['syncs']:.2f})")
        named = [rows[key] for key in ("mirror @meta", "captured @meta") if key in rows]
        others = [row for key, row in rows.items() if not key.startswith("megatron")]
        best = max(others, key=lambda row: row["speedup_vs_reference"], default=None)
        if best is not None and all(best is not row for row in named):
            named.append(best)
        shown += [f"{row['label']} {speed(row['speedup_vs_reference'])}" for row in named]
        patched = rows.get(MEGATRON_KEY)
        if patched is not None and "mirror @meta" in rows:
            pace = rows["mirror @meta"]["median_us"] / patched["median_us"]
            shown.append(f"{patched['label']} {speed(patched['speedup_vs_reference'])} "
                         f"({versus(pace, 'the mirror path')})")
        parts.append(f"{name} " + ", ".join(shown))
    steps = ", ".join(f"{name} {count}" for name, count in checked.items())
    capacity = "" if growth is None else f"; {growth_text(growth)}"
    return (f"verdict: every timed path left the reference's views and buffers on the "
            f"checked trace steps ({steps}; CPU); the reference's host µs per step over "
            f"each path's on meta (the host's share of a GPU step): {'; '.join(parts)}"
            f"{capacity}")


#: What ``--trace --targets`` prints above its ``target:`` lines.
TRACE_TARGETS_NOTE = """\
trace targets (maintainers' performance goals, host share on meta against the row's
  reference in the same run): Megatron's client placement through patch()'s helpers
  at least 3.5x upstream's helpers on the standard trace and 2x on the production one,
  with no more syncs per step than upstream's and at most a third of its device data
  ops; the mirror path 3x and the captured loop 5x the reference on the standard trace;
  on the production trace the mirror path at or above the reference, the captured
  loop 2x, the mirror path with block counts 3x; with block counts the W 8192 table
  within 1.3x of the W 2048 one. MISSED is no wrong result (every row was checked
  first) and leaves the exit status 0."""

#: ``(geometry, row key, least speed-up over its reference)``.
_SPEED_TARGETS = (("standard", ENGINE_KEY, 3.5), ("production", ENGINE_KEY, 2.0),
                  ("standard", "mirror @meta", 3.0), ("standard", "captured @meta", 5.0),
                  ("production", "mirror @meta", 1.0), ("production", "captured @meta", 2.0),
                  ("production", "mirror, block counts @meta", 3.0))


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def trace_target_lines(out: Dict[str, Any], growth: Optional[Growth] = None) -> List[str]:
    """Each trace target this run can judge, with its figures, one line each."""
    lines = []
    for name, key, least in _SPEED_TARGETS:
        row = out.get(name, {}).get("rows", {}).get(key)
        if row is not None:
            ratio = row["speedup_vs_reference"]
            spread = pass_spread(row)
            lines.append(f"{name}: {row['label']} {speed(ratio)} its reference"
                         f"{', ' + spread if spread else ''} (target >= {least:.1f}x): "
                         f"{_verdict(ratio >= least)}")
    for name, result in out.items():
        rows = result["rows"]
        if ENGINE_KEY in rows and ENGINE_REFERENCE_KEY in rows:
            ours, upstream = rows[ENGINE_KEY], rows[ENGINE_REFERENCE_KEY]
            ok = (ours["syncs"] <= upstream["syncs"]
                  and 3 * ours["device_data_ops"] <= upstream["device_data_ops"])
            lines.append(f"{name}: {ours['label']} {ours['syncs']:.2f} syncs and "
                         f"{ours['device_data_ops']:.1f} device data ops per step against "
                         f"upstream's {upstream['syncs']:.2f} and "
                         f"{upstream['device_data_ops']:.1f} (target: no more syncs, at "
                         f"most a third of the ops): {_verdict(ok)}")
    if growth is not None and "mirror, block counts" in growth[0]:
        ratio = growth[0]["mirror, block counts"]
        lines.append(f"mirror, block counts: W {growth[2]} {ratio:.2f}x the µs of W "
                     f"{growth[1]} (target <= 1.3x): {_verdict(ratio <= 1.3)}")
    return lines
