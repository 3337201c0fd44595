"""The fresh-shapes row of ``mtpmeta bench``: steps that never repeat a shape.

The mirror path memoizes per-shape plans (layouts, copy plans, views) on the view and
the metadata; a bench that replays the same few steps measures those caches warm. Here
every step of a pass has its own active count, its own padded count (a different
multiple of ``tp``), its own commit size and token padding, and every pass starts from
new objects, so no plan is ever reused: the cost of a never-seen shape. Each new object
first runs one step of yet another shape, untimed there: its first use, timed apart
with the object's build and allocation (the mirror path builds the views over its
real counts then, for every count). Both are reported next to the same paths
replaying one repeated shape, in the same run.
"""

from __future__ import annotations

import statistics
import textwrap
import time
from dataclasses import replace
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

__all__ = ["max_fresh_steps", "fresh_steps", "measure_fresh_shapes",
           "format_fresh_shapes"]

PATHS = ("reference", "direct", "mirror")


def max_fresh_steps(config) -> int:
    """How many steps with distinct padded counts ``config``'s request slots allow."""
    return (config.max_requests - 1) // config.tp - 1


def fresh_steps(config, count: int = 20, seed: int = 0) -> List[Tuple[Any, Any]]:
    """``count`` ``(StepConfig, StepInputs)`` pairs, no two with the same active count,
    padded count or prefill size (hence commit size and pad)."""
    from mtpmeta.buffers.layout import round_up
    from mtpmeta.bench.workload import make_steps

    tp = config.tp
    buckets = (config.max_requests - 1) // tp  # padded counts that fit with the prefill
    if count > max_fresh_steps(config):
        raise ValueError(f"fresh_steps: {count} distinct padded counts need more than "
                         f"max_requests {config.max_requests} at tp {tp}")
    rng = np.random.default_rng(seed)
    padded = rng.choice(np.arange(2, buckets + 1), size=count, replace=False) * tp
    # The prefill chunk starts half a block before its inherited blocks end and must
    # stay inside the table.
    prefill_start = config.inherited_blocks * config.block_size - config.block_size // 2
    most = min(64 * tp, config.block_columns * config.block_size - prefill_start)
    prefill = rng.choice(np.arange(1, most + 1), size=count, replace=False)
    out = []
    for i, (pad, tokens) in enumerate(zip(padded, prefill)):
        active = int(pad) - int(rng.integers(0, tp))  # rounds up to this padded count
        step_config = replace(config, active=active, prefill_tokens=int(tokens))
        if round_up(active, tp) != pad or active + 1 > config.max_requests:
            raise RuntimeError("fresh_steps: bad draw")  # cannot happen: a guard
        out.append((step_config, make_steps(step_config, 1, seed=seed + i)[0]))
    return out


def _build(path: str, config):
    from mtpmeta.bench.variants import build

    return build(path, config, torch.device("cpu"))


def measure_fresh_shapes(config, *, count: int = 20, repeats: int = 5,
                         seed: int = 0) -> Dict[str, Any]:
    """µs per step of each path over never-repeated shapes (new objects each pass, each
    after its first use on one more shape), ms of that first use (build, allocate, the
    step), and µs per step over ``count`` replays of one shape after a warm-up, medians
    of ``repeats``. Needs ``count + 1 <= max_fresh_steps(config)``."""
    from mtpmeta.bench.workload import run_step

    torch.set_num_threads(1)
    drawn = fresh_steps(config, count + 1, seed)
    first, steps = drawn[0], drawn[1:]
    # Objects sized for the largest step (max_tokens grows with both sizes).
    sizing = replace(config, active=max(c.active for c, _ in drawn),
                     prefill_tokens=max(c.prefill_tokens for c, _ in drawn))
    fresh: Dict[str, List[float]] = {p: [] for p in PATHS}
    first_use: Dict[str, List[float]] = {p: [] for p in PATHS}
    repeated: Dict[str, List[float]] = {p: [] for p in PATHS}
    warm_objects = {p: _build(p, sizing) for p in PATHS}
    one = steps[0]
    for path, (meta, view) in warm_objects.items():
        for _ in range(2):
            run_step(meta, view, one[1], one[0])
    for _ in range(repeats):
        for path in PATHS:  # interleaved by path, fresh objects each pass
            start = time.perf_counter_ns()
            meta, view = _build(path, sizing)
            run_step(meta, view, first[1], first[0])
            first_use[path].append((time.perf_counter_ns() - start) / 1e6)
            start = time.perf_counter_ns()
            for step_config, inputs in steps:
                run_step(meta, view, inputs, step_config)
            fresh[path].append((time.perf_counter_ns() - start) / count / 1e3)
            meta, view = warm_objects[path]
            start = time.perf_counter_ns()
            for _ in range(count):
                run_step(meta, view, one[1], one[0])
            repeated[path].append((time.perf_counter_ns() - start) / count / 1e3)
    return {"count": count,
            "fresh_us_per_step": {p: statistics.median(v) for p, v in fresh.items()},
            "first_use_ms": {p: statistics.median(v) for p, v in first_use.items()},
            "repeated_us_per_step": {p: statistics.median(v) for p, v in repeated.items()}}


def format_fresh_shapes(result: Dict[str, Any]) -> str:
    fresh, repeated = result["fresh_us_per_step"], result["repeated_us_per_step"]
    lines = [f"fresh shapes ({result['count']} steps, no shape seen twice, new objects "
             "each pass after one step of another shape) vs one repeated shape, µs per "
             "step:"]
    for path in fresh:
        lines.append(f"  {path:<10} fresh {fresh[path]:>9,.0f}   repeated "
                     f"{repeated[path]:>9,.0f}   fresh/repeated "
                     f"{fresh[path] / repeated[path]:>5.2f}x   reference/path fresh "
                     f"{fresh['reference'] / fresh[path]:>5.2f}x")
    first = result.get("first_use_ms")
    if first:
        lines.append(textwrap.fill(
            "  first use of a new object (build, allocate, one step), ms: " + ", ".join(
                f"{path} {ms:,.1f}" for path, ms in first.items()) + " (the mirror path "
            "builds its views over the real counts then, for every count: "
            "docs/architecture.md, Mirror path costs)", width=88, subsequent_indent="    "))
    slower = [path for path in fresh if fresh[path] > fresh["reference"]]
    if slower:
        lines.append(textwrap.fill(
            f"  reference/path below 1x ({', '.join(slower)}): slower than the reference "
            f"when no shape repeats, because each new shape builds that path's plans "
            f"(layouts, copy plans, views) and every pass starts from new objects; an "
            f"engine repeats its shapes, which the repeated column times",
            width=88, subsequent_indent="    "))
    return "\n".join(lines)
