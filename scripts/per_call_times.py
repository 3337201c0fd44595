"""µs per public call with numpy inputs and with torch inputs, side by side in one run.

Usage: python scripts/per_call_times.py [--impl direct|mirror] [--number N] [--repeats R]

The cases are ``mtpmeta.bench.percall``'s (the same ``mtpmeta bench`` prints for the direct
path): each method called ``N`` times on the same inputs, numpy and torch interleaved,
best of ``R``. Caches are warm, so the numbers are smaller than the step's share measured
by ``python -m mtpmeta bench``; they show what the wrappers' input handling costs, not
what a step costs. Compare them only within one run.
"""

from __future__ import annotations

import argparse

import torch

from mtpmeta.bench.percall import format_input_cost, input_cost
from mtpmeta.bench.workload import StepConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", default="direct", choices=("direct", "mirror"))
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = input_cost(StepConfig(), repeats=args.repeats, number=args.number,
                         mirror=args.impl == "mirror")
    print(format_input_cost(results, args.impl))


if __name__ == "__main__":
    main()
