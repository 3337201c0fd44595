"""The default route's table passes against the floors of reading and of copying the
same rows, in place: how far the production geometry's table passes are from the least
a pass that must see every entry can cost.

Usage: ``python scripts/table_pass_floor.py [steps]`` (default 60; about 1 min).

The mirror path replays the production trace (``mtpmeta bench --trace``'s, engine
order, on meta with the C++ meta kernels). A default-route call on a table this wide
reads its rows once, ``native.draft_state.used_columns`` (the begin's ``[n, W]`` and
the commit's ``[P, W]`` rows; ``mtpmeta/mirror/counted.py``, "Derived counts"), then
writes only the used columns. Each such read is timed next to ``ndarray.max`` over the
same rows (a plain read: the least a pass that must see every entry costs) and an
``np.copyto`` of them into a scratch (the snapshot whole rows cost), in rotating order
so all three meet the cache alike. Figures compare only within a run.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from mtpmeta import native
from mtpmeta.bench.meta_device import cpp_meta_kernels
from mtpmeta.bench.trace import PRODUCTION_TRACE, make_trace
from mtpmeta.bench.counters import CountingRuntime
from mtpmeta.bench.trace_replay import Replay
from mtpmeta.buffers.device_runtime import use_runtime


def _timed(samples: Dict[str, List[float]], key: str, run: Callable[[], object]) -> object:
    start = time.perf_counter_ns()
    out = run()
    samples.setdefault(key, []).append((time.perf_counter_ns() - start) / 1e3)
    return out


def _beside_floors(kernel: Callable, samples: Dict[str, List[float]]) -> Callable:
    """``used_columns(table, rows, out)`` timed with a read and a copy of its rows,
    the three in an order that rotates call by call."""
    scratch: List[np.ndarray] = []
    calls = [0]

    def wrapped(table, rows, out):
        if not scratch:
            scratch.append(np.empty_like(table))
        runs = [("used_columns (the pass)", lambda: kernel(table, rows, out)),
                ("ndarray.max (a read)", lambda: table[:rows].max()),
                ("np.copyto (a copy)",
                 lambda: np.copyto(scratch[0][:rows], table[:rows]))]
        calls[0] += 1
        shift = calls[0] % len(runs)
        result = None
        for key, run in runs[shift:] + runs[:shift]:
            value = _timed(samples, key, run)
            if key.startswith("used_columns"):
                result = value
        return result

    return wrapped


def main(steps: int = 60) -> None:
    torch.set_num_threads(1)
    trace = make_trace(PRODUCTION_TRACE, steps)
    samples: Dict[str, List[float]] = {}
    kernel = native.draft_state.used_columns
    with cpp_meta_kernels(), use_runtime(CountingRuntime()):
        replay = Replay("mirror", PRODUCTION_TRACE, torch.device("meta"))
        replay.replay(trace)  # JIT, plans
        try:
            native.draft_state.used_columns = _beside_floors(kernel, samples)
            replay.replay(trace)
        finally:
            native.draft_state.used_columns = kernel
    print(f"production trace (R {PRODUCTION_TRACE.max_requests}, W "
          f"{PRODUCTION_TRACE.block_columns}), {steps} steps, mirror path, default route: "
          "median µs per table pass (a begin's or a commit pass's rows)")
    for key in sorted(samples):
        median = statistics.median(samples[key])
        print(f"  {key:<28} {median:8.0f}  ({len(samples[key])} calls)")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:2]))
