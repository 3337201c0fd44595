"""The default route's two table passes against ``np.copyto`` of the same rows, in place
(issue 24 item 5: the guarantee the production target cannot be met without).

Usage: ``python scripts/table_pass_floor.py [steps]`` (default 60; about 1 min).

The mirror path replays the production trace (``mtpmeta bench --trace``'s, engine
order, on meta with the C++ meta kernels). Each call of the two kernels that read a
whole table, ``copy_decode_inputs`` (the begin's ``[n, W]`` rows into the pinned begin
slot) and ``commit_pass`` (the commit's ``[P, W]`` rows into the pinned commit slot,
its checks and token maps included), is timed next to an ``np.copyto`` of the same
rows into a scratch of the same shape, in alternating order, so both meet the cache in
the same state. ``np.copyto`` is a plain memcpy: the least a snapshot of rows the
caller may change afterwards can cost on the host. Figures compare only within a run.
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
from mtpmeta.bench.trace_replay import CountingRuntime, Replay
from mtpmeta.runtime import use_runtime

#: (module, kernel, index of its count-or-rows argument, index of its table argument)
KERNELS = ((native.draft_state, "copy_decode_inputs", 2, 1),
           (native.staging, "commit_pass", None, 3))


def _timed(samples: Dict[str, List[float]], key: str, run: Callable[[], object]) -> object:
    start = time.perf_counter_ns()
    out = run()
    samples.setdefault(key, []).append((time.perf_counter_ns() - start) / 1e3)
    return out


def _beside_copyto(kernel: Callable, name: str, rows_at, table_at,
                   samples: Dict[str, List[float]]) -> Callable:
    """``kernel`` timed with an ``np.copyto`` of its table rows before it on odd calls
    and after it on even ones."""
    scratch: List[np.ndarray] = []
    calls = [0]

    def wrapped(*args):
        table = args[table_at]
        # commit_pass: its first argument is the per-request counts, one row each.
        rows = args[rows_at] if rows_at is not None else args[0].shape[0]
        if not scratch:
            scratch.append(np.empty_like(table))
        copy = lambda: np.copyto(scratch[0][:rows], table[:rows])  # noqa: E731
        call = lambda: kernel(*args)  # noqa: E731
        calls[0] += 1
        if calls[0] % 2:
            _timed(samples, f"{name}: np.copyto", copy)
            return _timed(samples, f"{name}: kernel", call)
        out = _timed(samples, f"{name}: kernel", call)
        _timed(samples, f"{name}: np.copyto", copy)
        return out

    return wrapped


def main(steps: int = 60) -> None:
    torch.set_num_threads(1)
    trace = make_trace(PRODUCTION_TRACE, steps)
    samples: Dict[str, List[float]] = {}
    with cpp_meta_kernels(), use_runtime(CountingRuntime()):
        replay = Replay("mirror", PRODUCTION_TRACE, torch.device("meta"))
        replay.replay(trace)  # JIT, plans
        originals = [(module, name, getattr(module, name))
                     for module, name, _, _ in KERNELS]
        try:
            for (module, name, rows_at, table_at), (_, _, kernel) in zip(KERNELS,
                                                                        originals):
                setattr(module, name,
                        _beside_copyto(kernel, name, rows_at, table_at, samples))
            replay.replay(trace)
        finally:
            for module, name, kernel in originals:
                setattr(module, name, kernel)
    print(f"production trace (R {PRODUCTION_TRACE.max_requests}, W "
          f"{PRODUCTION_TRACE.block_columns}), {steps} steps, mirror path, default route: "
          "median µs per call")
    for key in sorted(samples):
        median = statistics.median(samples[key])
        print(f"  {key:<32} {median:8.0f}  ({len(samples[key])} calls)")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:2]))
