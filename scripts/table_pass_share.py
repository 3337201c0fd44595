"""The share of a production step's host time that the table passes take: what a split
of those passes over more threads could give a step at most.

Usage: ``python scripts/table_pass_share.py [steps]`` (default 12; about 20 s).

The mirror path replays the production trace (``mtpmeta bench --trace``'s, on meta with
the C++ meta kernels), with and without block counts. The table passes are the kernels
whose work grows with the table's rows: ``native.draft_state.used_columns`` (a wide
default-route call's scan), ``stage_counted_inputs`` and ``native.counts.
write_counted_rows`` (the packed-row copies). Each is wrapped in a timer; a pass over the
trace gives their share ``s`` of the steps' time, and ``1 / (1 - s / 2)`` is the most
two threads could speed a step up with those passes split perfectly and nothing else.
Best of 3 passes; figures compare only within a run.
"""

from __future__ import annotations

import sys
import time
from typing import Dict

import torch

from mtpmeta import native
from mtpmeta.bench import trace_bench
from mtpmeta.bench.meta_device import cpp_meta_kernels
from mtpmeta.bench.trace import PRODUCTION_TRACE, make_trace
from mtpmeta.bench.trace_replay import known_syncs

PASSES = ((native.draft_state, "used_columns"), (native.draft_state, "stage_counted_inputs"),
          (native.counts, "write_counted_rows"))


def main(steps: int) -> None:
    torch.set_num_threads(1)
    spent: Dict[str, int] = {}
    for module, name in PASSES:
        kernel = getattr(module, name)

        def timed(*args, kernel=kernel, name=name):
            start = time.perf_counter_ns()
            result = kernel(*args)
            spent[name] = spent.get(name, 0) + time.perf_counter_ns() - start
            return result

        setattr(module, name, timed)
    trace = make_trace(PRODUCTION_TRACE, steps, seed=0)
    known = {("reference", False): known_syncs(PRODUCTION_TRACE, trace)}
    for counts in (False, True):
        row = trace_bench.TraceRow("mirror", "mirror", block_counts=counts)
        with cpp_meta_kernels():
            replay = trace_bench._replay(row, PRODUCTION_TRACE, known)
            replay.replay(trace)  # warm
            passes = []
            for _ in range(3):
                spent.clear()
                total = sum(trace_bench._timed_pass(replay, trace))
                passes.append((total, dict(spent)))
        total, parts = min(passes, key=lambda item: item[0])
        share = sum(parts.values()) / 1e3 / total
        detail = ", ".join(f"{name} {value / 1e3 / steps:.0f}"
                           for name, value in sorted(parts.items()))
        print(f"mirror{', block counts' if counts else ''}: {total / steps:.0f} µs per "
              f"step, table passes {share:.1%} ({detail} µs per step); two threads at "
              f"most {1 / (1 - share / 2):.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
