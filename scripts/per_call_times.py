"""µs per public call of the standard step, each call timed on its own (warm, timeit).

Usage: python scripts/per_call_times.py [--impl direct|mirror|reference] [--number N]

The same call is repeated on the same inputs, so caches are warm and the numbers are
smaller than the step's share measured by ``python -m mtpmeta bench``; they show where
the wrappers spend time, not what a step costs. Compare them only within one run.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from mtpmeta.bench import build
from mtpmeta.workload import StepConfig, make_steps, run_commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", default="direct", choices=("direct", "mirror", "reference"))
    parser.add_argument("--number", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = StepConfig()
    inputs = make_steps(config, 1)[0]
    meta, view = build(args.impl, config, torch.device("cpu"))
    count = config.active
    padded = -(-count // config.tp) * config.tp

    def begin() -> None:
        meta.begin_decode(count, padded, inputs.start_positions, inputs.block_table, False)

    calls = {
        "move_request_rows": lambda: meta.move_request_rows(inputs.move_src, inputs.move_dst),
        "swap_request_rows": lambda: meta.swap_request_rows(inputs.swap_src, inputs.swap_dst),
        "reset_request_rows": lambda: meta.reset_request_rows(inputs.reset_rows),
        "carry_chunk_boundary": lambda: meta.carry_chunk_boundary(
            inputs.hidden, inputs.carry_req_id, inputs.carry_position),
        "take_chunk_boundary": lambda: meta.take_chunk_boundary(
            inputs.carry_req_id, inputs.carry_position),
        "begin_decode": begin,
        "setup_decode_step": lambda: meta.setup_decode_step(view),
        # Offsets only grow here; nothing reads them until the next begin_decode.
        "advance_decode_step": meta.advance_decode_step,
        "end_forward": meta.end_forward,
        "setup_commit_pass + end_forward": lambda: run_commit(meta, view, inputs),
    }
    print(f"{args.impl}: µs per call, best of 5 x {args.number}")
    for name, call in calls.items():
        if name == "setup_decode_step":
            begin()  # DRAFT mode; repeated depths at the same offsets stay in the table
        call()
        best = min(timeit.repeat(call, number=args.number, repeat=5)) / args.number
        print(f"  {name:<34}{best * 1e6:8.2f}")


if __name__ == "__main__":
    main()
