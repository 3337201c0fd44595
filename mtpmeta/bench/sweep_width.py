"""``mtpmeta bench --width-sweep``: per-draft-depth host cost over the table width.

A draft depth's host work must follow the requests, not the table's capacity: the
block table crosses to the device once per draft loop (``begin_decode``) and each depth
fills ``mha_block_table`` from the persistent device copy. This sweep holds N = 256
active requests and varies ``W = max_kv_block_count`` over {128, 512, 2048, 8192}; per
depth (``setup_decode_step`` + ``advance_decode_step``) it reports instructions under
callgrind where valgrind is installed (load-independent), else wall-clock µs, for the
mirror path with its buffers and view on torch's ``meta`` device (every op is
dispatched in full but moves no data: the host's share of a GPU step; CPU-forced, the
device copies would run on the host and grow with W as a GPU's copy engine does), the
direct path and the reference (whose ops are host work: on the CPU the device is the
host), and the mirror path's host-to-device bytes per depth (``bench.h2d``). The target: the mirror path's
instructions at W = 8192 within 1.2x of W = 128.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["WIDTHS", "ACTIVE", "width_config", "width_sweep", "format_width_sweep"]

WIDTHS = (128, 512, 2048, 8192)
ACTIVE = 256  # N, the active requests of every cell
PATHS = ("mirror", "direct", "reference")


WARM_DEPTHS = 9  # more than the forward ring's default 8 slots, each with its own plan


def width_config(width: int, active: int = 256):
    """The standard step at ``active`` requests (R = active + 64) and width ``width``."""
    from mtpmeta.bench.workload import StepConfig

    return StepConfig(max_requests=active + 64, block_columns=width, active=active)


def _depth_runs(widths: Sequence[int], active: int, depths: int):
    """``{(path, W): (begin, depth, meta)}`` on warm objects: ``begin()`` starts a draft
    loop, ``depth()`` runs one depth (setup + advance)."""
    from dataclasses import replace

    from mtpmeta.bench.variants import build
    from mtpmeta.bench.workload import make_steps, run_step

    runs: Dict[Any, Any] = {}
    for width in widths:
        config = width_config(width, active)
        # Start positions leave room for 64 advances: a region runs many depths.
        steps = make_steps(replace(config, depths=64), 2, seed=0)
        for path in PATHS:
            # The mirror path on the meta device: every torch op is dispatched in full
            # but moves no data, as on a GPU, where the copies are the device's work.
            device = torch.device("meta" if path == "mirror" else "cpu")
            meta, view = build(path, config, device)
            for inputs in steps:  # warm: JIT, per-shape plans
                run_step(meta, view, inputs, config)
            inputs = steps[0]

            def begin(meta=meta, inputs=inputs, config=config):
                meta.begin_decode(config.active, config.padded_active,
                                  inputs.start_positions, inputs.block_table, False)

            def depth(meta=meta, view=view):
                meta.setup_decode_step(view)
                meta.advance_decode_step()

            runs[(path, width)] = (begin, depth, meta)
    return runs


def depth_regions(region: Callable[[str, Callable[[], None]], None], widths: List[int],
                  active: int, calls: int) -> None:
    """Child side of the callgrind run: one region per (path, W) of ``calls`` depths of
    one draft loop (begun outside the region; positions stay inside the table). Before
    each region a loop of ``WARM_DEPTHS`` depths builds the copy plan of every staging
    slot: a plan built inside one region only would be charged to that width alone
    (``region`` keeps the garbage collector out the same way)."""
    torch.set_num_threads(1)
    runs = _depth_runs(widths, active, 3)
    for (path, width), (begin, depth, meta) in runs.items():
        begin()
        for _ in range(WARM_DEPTHS):
            depth()
        begin()
        region(f"{path} W={width}", lambda depth=depth: [depth() for _ in range(calls)])
        meta.end_forward()


def _h2d_per_depth(width: int, active: int) -> int:
    from mtpmeta.buffers.device_runtime import use_runtime
    from mtpmeta.bench.h2d import H2DCounter, StagingRecorder
    from mtpmeta.bench.variants import build
    from mtpmeta.bench.workload import make_steps, run_step

    config = width_config(width, active)
    recorder = StagingRecorder()
    with use_runtime(recorder):
        meta, view = build("mirror", config, torch.device("cpu"))
    inputs = make_steps(config, 1, seed=0)[0]
    run_step(meta, view, inputs, config)
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, False)
    with H2DCounter(recorder) as counter:
        meta.setup_decode_step(view)
    meta.end_forward()
    return counter.nbytes


def width_sweep(widths: Optional[Sequence[int]] = None, active: Optional[int] = None, *,
                repeats: int = 15, instructions: bool = True, calls: int = 30,
                spread: Optional[Dict[str, Dict[int, Tuple[float, float]]]] = None
                ) -> Dict[str, Any]:
    """Per-depth cost of each path at each width: ``{"unit", "per_depth": {path: {W:
    cost}}, "h2d_bytes_per_depth": {W: bytes}, "mirror_growth"}`` (widths default to
    ``WIDTHS``, ``active`` to ``ACTIVE``, read at the call). A ``spread`` dict given gets
    each cell's lowest and highest timed pass (one count twice under callgrind)."""
    from mtpmeta.bench.instructions import callgrind_regions, unavailable

    widths = WIDTHS if widths is None else widths
    active = ACTIVE if active is None else active
    result: Dict[str, Any] = {"active": active, "widths": list(widths)}
    result["h2d_bytes_per_depth"] = {w: _h2d_per_depth(w, active) for w in widths}
    reason = unavailable() if instructions else "not asked for"
    per_depth: Dict[str, Dict[int, float]] = {path: {} for path in PATHS}
    if reason is None:
        body = ("from mtpmeta.bench.sweep_width import depth_regions\n"
                f"depth_regions(region, {json.dumps(list(widths))}, {active}, {calls})\n")
        for label, count in callgrind_regions(body).items():
            path, width = label.split(" W=")
            per_depth[path][int(width)] = count / calls
        result["unit"] = "instructions"
    else:
        torch.set_num_threads(1)
        runs = _depth_runs(widths, active, 3)
        samples: Dict[Any, List[float]] = {key: [] for key in runs}
        for _ in range(repeats):  # interleaved: a load change hits every cell alike
            for key, (begin, depth, meta) in runs.items():
                begin()
                start = time.perf_counter_ns()
                for _ in range(3):
                    depth()
                samples[key].append((time.perf_counter_ns() - start) / 3 / 1e3)
                meta.end_forward()
        for (path, width), values in samples.items():
            per_depth[path][width] = statistics.median(values)
            if spread is not None:
                spread.setdefault(path, {})[width] = (min(values), max(values))
        result["unit"] = f"µs (wall clock; no instruction counts: {reason})"
    if spread is not None and result["unit"] == "instructions":
        for path, row in per_depth.items():
            spread[path] = {width: (count, count) for width, count in row.items()}
    result["per_depth"] = per_depth
    mirror = per_depth["mirror"]
    result["mirror_growth"] = mirror[max(widths)] / mirror[min(widths)]
    return result


def format_width_sweep(result: Dict[str, Any]) -> str:
    widths = result["widths"]
    lines = [f"per draft depth over the table width (N {result['active']}; "
             f"{result['unit']})",
             "  " + f"{'W':<22}" + "".join(f"{w:>12}" for w in widths)]
    for path, row in result["per_depth"].items():
        lines.append("  " + f"{path:<22}" + "".join(f"{row[w]:>12,.0f}" for w in widths))
    lines.append("  " + f"{'mirror H2D bytes':<22}" + "".join(
        f"{result['h2d_bytes_per_depth'][w]:>12,}" for w in widths))
    note = "" if result["unit"] == "instructions" else (
        "; the target is for instruction counts (--instructions): wall-clock µs swing "
        "with the machine's load")
    lines.append(f"  mirror at W {max(widths)} / W {min(widths)}: "
                 f"{result['mirror_growth']:.2f}x (target <= 1.2x{note})")
    return "\n".join(lines)
