"""Per-call host cost of each public method, torch inputs against numpy inputs.

Every case calls one public method of a direct-path ``MTPMetadata`` twice over: once
with the torch CPU tensors a scheduler holds (the seed's types: int64 row tensors and
slices of them, int32 tables, 0-d tensors from indexing a tensor, a ``[1, 1, H]``
hidden) and once with the numpy counterparts (arrays, and ``np.int64`` scalars from
indexing an array). The two are timed interleaved, ``repeats`` times ``number`` calls
each, best of the repeats, so a load change hits both alike. ``torch / numpy`` above 1
is what torch inputs cost extra.

The same call repeats on the same inputs: caches are warm and the numbers are smaller
than a method's share of a step (``mtpmeta bench``); they show the wrappers' input
handling, not what a step costs. Compare them only within one run.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from mtpmeta.gpu_view import ContextGPUView
from mtpmeta.metadata import MTPMetadata
from mtpmeta.bench.workload import StepConfig, StepInputs, make_steps

__all__ = ["input_cost", "format_input_cost"]

Call = Callable[[], Any]
_REQ_ID, _POSITION = 7, 9  # carry keys small enough to be 0-d tensors of a row arange


def _numpy_side(value: Any) -> Any:
    """The numpy counterpart of a torch input (0-d tensors become numpy scalars)."""
    if isinstance(value, torch.Tensor):
        array = value.numpy()
        return array[()] if array.ndim == 0 else array
    return value


def _cases(meta: MTPMetadata, view: ContextGPUView, step: StepInputs,
           config: StepConfig) -> Dict[str, Tuple[Call, Call]]:
    """``{label: (numpy call, torch call)}`` over the public methods that take inputs."""
    n, padded = config.active, config.padded_active
    mask = torch.zeros(config.max_requests, dtype=torch.bool)
    mask[step.reset_rows] = True
    rows = torch.arange(config.max_requests)  # int64, as torch.arange gives
    tokens = torch.arange(n, dtype=torch.int32)
    lengths = step.start_positions[:n] + 1
    torch_args: Dict[str, Tuple[str, tuple]] = {
        "move_request_rows (int64 [16])": (
            "move_request_rows", (step.move_src, step.move_dst)),
        "swap_request_rows (slices [:4])": (
            "swap_request_rows", (step.move_dst[:4], step.move_src[:4])),
        "reset_request_rows (nonzero int64)": ("reset_request_rows", (step.reset_rows,)),
        "reset_request_rows (bool mask)": ("reset_request_rows", (mask,)),
        "reset_request_rows (0-d index)": ("reset_request_rows", (rows[5],)),
        "carry_chunk_boundary ([1, 1, H])": (
            "carry_chunk_boundary", (step.hidden, _REQ_ID, _POSITION)),
        "take_chunk_boundary (0-d ids)": (
            "take_chunk_boundary", (rows[_REQ_ID], rows[_POSITION])),
        "begin_decode (tensors, ints)": (
            "begin_decode", (n, padded, step.start_positions, step.block_table,
                             config.graphed)),
        "begin_decode (0-d counts)": (
            "begin_decode", (rows[n], rows[padded], step.start_positions,
                             step.block_table, config.graphed)),
        "stage_prefill_lengths": ("stage_prefill_lengths", (step.append_counts, 3)),
        "write_token_maps": (
            "write_token_maps", (view, tokens, step.start_positions, step.block_table,
                                 padded)),
        "write_mha_metadata": (
            "write_mha_metadata", (view, lengths, lengths, step.block_table[:n], padded)),
    }
    cases: Dict[str, Tuple[Call, Call]] = {}
    for label, (method, args) in torch_args.items():
        bound = getattr(meta, method)
        numpy_args = tuple(_numpy_side(arg) for arg in args)
        cases[label] = (lambda f=bound, a=numpy_args: f(*a),
                        lambda f=bound, a=args: f(*a))
    commit_kwargs = dict(start_positions=step.commit_starts,
                         inherited_blocks=step.inherited,
                         padded_token_count=step.padded_tokens,
                         padded_request_count=step.padded_requests)
    numpy_kwargs = {key: _numpy_side(value) for key, value in commit_kwargs.items()}
    cases["setup_commit_pass"] = (
        lambda: meta.setup_commit_pass(view, _numpy_side(step.append_counts),
                                       _numpy_side(step.block_table), **numpy_kwargs),
        lambda: meta.setup_commit_pass(view, step.append_counts, step.block_table,
                                       **commit_kwargs))
    meta.carry_chunk_boundary(step.hidden, _REQ_ID, _POSITION)  # what take asks for
    return cases


def _best_per_call(call: Call, number: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(number):
        call()
    return (time.perf_counter_ns() - start) / number / 1e3


def input_cost(config: StepConfig = StepConfig(), repeats: int = 7,
               number: int = 1000, mirror: bool = False) -> Dict[str, Dict[str, float]]:
    """``{case: {"numpy_us", "torch_us", "ratio"}}``: best-of-``repeats`` µs per call,
    numpy and torch timed interleaved (see the module docstring); the direct path, or
    the CPU-forced mirror path with ``mirror=True``."""
    step = make_steps(config, 1, seed=0)[0]
    meta = MTPMetadata(**config.metadata_kwargs())
    meta.allocate("cpu", mirror=mirror, max_tokens=config.max_tokens)
    view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
    results: Dict[str, Dict[str, float]] = {}
    for label, (numpy_call, torch_call) in _cases(meta, view, step, config).items():
        numpy_call(), torch_call()  # warm: JIT, per-shape caches
        numpy_times: List[float] = []
        torch_times: List[float] = []
        for _ in range(repeats):
            numpy_times.append(_best_per_call(numpy_call, number))
            torch_times.append(_best_per_call(torch_call, number))
        numpy_us, torch_us = min(numpy_times), min(torch_times)
        results[label] = {"numpy_us": numpy_us, "torch_us": torch_us,
                          "ratio": torch_us / numpy_us}
    meta.end_forward()
    return results


def format_input_cost(results: Dict[str, Dict[str, float]], path: str = "direct") -> str:
    lines = [f"{f'per call, {path} path (µs, best of repeats)':<46}{'numpy':>8}{'torch':>8}"
             f"{'torch/numpy':>13}"]
    for label, row in results.items():
        lines.append(f"  {label:<44}{row['numpy_us']:>8.2f}{row['torch_us']:>8.2f}"
                     f"{row['ratio']:>12.2f}x")
    return "\n".join(lines)
