"""Callgrind instructions per standard-trace step of Megatron's client placement: the
helpers ``patch()`` installs against upstream's helpers on the same placement (the
trace bench's "megatron, engine placement" rows and their baseline), a host-share ratio
that does not move with the machine's load, beside ``mtpmeta bench --trace``'s µs.

Usage: ``python scripts/engine_instructions.py [steps]`` (default 80 steps of the
standard trace, about 4 minutes; needs valgrind and the ``bench`` extra). Each row is
replayed twice uninstrumented (JIT, plans, caches), then once with instructions
counted for each step's calls only (``Replay.run``; the untimed ``Replay.prepare``,
the client's own input placement, is left out, as the bench leaves it out of its time),
inside ``torch.inference_mode()`` as the bench steps them.
"""

from __future__ import annotations

import sys

from mtpmeta.bench.instructions import callgrind_regions, unavailable

ROWS = ("reference, engine placement", "megatron, engine placement",
        "megatron, engine placement, byte-exact")

_BODY = '''
import torch
from mtpmeta.bench import trace_bench
from mtpmeta.bench.trace import STANDARD_TRACE, make_trace
from mtpmeta.bench.trace_replay import known_syncs
from mtpmeta.bench.meta_device import cpp_meta_kernels
torch.set_num_threads(1)
config = STANDARD_TRACE
trace = make_trace(config, {steps}, seed=0)  # read-backs recorded on it, on the CPU
placed = trace_bench.device_inputs(trace, "meta")
with cpp_meta_kernels():
    for label in {rows!r}:
        row = next(r for r in trace_bench.ROWS if r.label == label)
        sequence = trace_bench.known_sequence(row)
        replay = trace_bench._replay(row, config,
                                     {{sequence: known_syncs(config, trace, *sequence)}})
        with torch.inference_mode():  # the engine's step mode, as the trace bench
            replay.replay(placed)
            replay.replay(placed)

        def run(replay=replay):
            replay.reset()
            with torch.inference_mode():
                for index, step in enumerate(placed):
                    _hooks.callgrind_stop_instrumentation()
                    replay.prepare(index, step)
                    _hooks.callgrind_start_instrumentation()
                    replay.run(step)
        region(label, run)
'''


def main(argv: list) -> int:
    steps = int(argv[1]) if len(argv) > 1 else 80
    reason = unavailable()
    if reason:
        print(f"engine_instructions: {reason}")
        return 1
    counts = callgrind_regions(_BODY.format(steps=steps, rows=ROWS), timeout=3600)
    baseline = counts[ROWS[0]]
    print(f"instructions per step, standard trace ({steps} steps), "
          f"Megatron's client placement:")
    for label in ROWS:
        print(f"  {label:40s} {counts[label] / steps / 1e3:9.1f}k  "
              f"{baseline / counts[label]:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
