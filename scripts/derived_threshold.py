"""Where the default route's derived counts pay: the thresholds of
``mtpmeta.mirror.counted`` (``DERIVED_MIN_ENTRIES``, ``DERIVED_MIN_WIDTH``) measured.

Usage: ``python scripts/derived_threshold.py [steps]`` (default 40; about 30 s).

For each geometry (the standard and the production trace of ``mtpmeta bench --trace``
at several widths W; the same requests, so wider tables only add -1 columns) the mirror
path replays the trace in engine order on meta with the C++ meta kernels (the host's
share on a GPU) twice: with the derived route forced off (every default call copies
or compares whole rows) and forced on (every default call reads its table once and
writes its used columns), beside the reference (upstream's op sequence), in interleaved
passes of one run. Printed per geometry: median µs per step of each, and which route the
default thresholds take there. Figures compare only within a run.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Dict, List

import torch

import mtpmeta.mirror.counted as counts
from mtpmeta.bench.meta_device import cpp_meta_kernels
from mtpmeta.bench.trace import PRODUCTION_TRACE, STANDARD_TRACE, TraceConfig, make_trace
from mtpmeta.bench.trace_bench import _timed_pass
from mtpmeta.bench.trace_replay import Replay, known_syncs

GEOMETRIES = [("standard", STANDARD_TRACE, w) for w in (128, 256, 512, 1024)] + \
    [("production", PRODUCTION_TRACE, w) for w in (128, 256, 512, 1024, 2048)]
REPEATS = 5
DEFAULTS = (counts.DERIVED_MIN_ENTRIES, counts.DERIVED_MIN_WIDTH)


def _force(derived: bool) -> None:
    counts.DERIVED_MIN_ENTRIES, counts.DERIVED_MIN_WIDTH = \
        (0, 0) if derived else (1 << 62, 1 << 62)


def measure(config: TraceConfig, steps: int) -> Dict[str, float]:
    """Median µs per step: ``whole``, ``derived`` and ``reference``."""
    trace = make_trace(config, steps, seed=0)
    replays = {}
    for label in ("whole", "derived"):
        _force(label == "derived")
        replays[label] = Replay("mirror", config, torch.device("meta"))
        replays[label].replay(trace)  # warm: JIT, plans, slots
    ref = replays["reference"] = Replay("reference", config, torch.device("meta"),
                                        known=known_syncs(config, trace))
    ref.replay(trace)
    samples: Dict[str, List[List[float]]] = {label: [] for label in replays}
    for _ in range(REPEATS):
        for label, replay in replays.items():
            if label != "reference":
                _force(label == "derived")
            samples[label].append(_timed_pass(replay, trace))
    counts.DERIVED_MIN_ENTRIES, counts.DERIVED_MIN_WIDTH = DEFAULTS
    return {label: statistics.median(statistics.median(step) for step in zip(*runs))
            for label, runs in samples.items()}


def main(steps: int = 40) -> None:
    torch.set_num_threads(1)
    print(f"thresholds: DERIVED_MIN_ENTRIES {DEFAULTS[0]}, DERIVED_MIN_WIDTH {DEFAULTS[1]}")
    print(f"{'geometry':<12}{'W':>6}{'n W':>9}{'whole':>8}{'derived':>9}{'reference':>11}"
          f"{'default takes':>15}")
    with cpp_meta_kernels():
        for name, base, width in GEOMETRIES:
            config = dataclasses.replace(base, block_columns=width)
            n = statistics.median(step.active for step in make_trace(config, steps, seed=0))
            us = measure(config, steps)
            route = "derived" if counts.derives(int(n * width), width) else "whole"
            print(f"{name:<12}{width:>6}{n * width / 1e3:>8.0f}k{us['whole']:>8.0f}"
                  f"{us['derived']:>9.0f}{us['reference']:>11.0f}{route:>15}")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:2]))
