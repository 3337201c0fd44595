"""The kernel floor of the standard step: the direct path's numba kernels alone.

``floor_step`` does the numba work of one standard step (``mtpmeta.bench.workload``) on a
direct-path ``MTPMetadata``, with the inputs converted to numpy beforehand and none of
the public methods' validation, mode bookkeeping or shape building. It leaves the view
and the buffers exactly as ``run_step`` does (the bench checks that before it times
anything), so ``µs per floor step`` is what the step costs once every wrapper is gone:
a lower bound for the direct path on the same machine, and the part of it that
Python-level work cannot remove.

Internal on purpose: it reaches into the backend, and exists only to be measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import numpy as np
import torch

from mtpmeta.kernels import native
from mtpmeta.metadata import MTPMetadata
from mtpmeta.bench.workload import StepConfig, StepInputs

__all__ = ["FloorInputs", "TorchFloorInputs", "prepare", "floor_step"]


@dataclass
class FloorInputs:
    """One standard step's inputs as the kernels take them (numpy, converted once)."""

    move_src: np.ndarray
    move_dst: np.ndarray
    swap_src: np.ndarray
    swap_dst: np.ndarray
    reset_rows: np.ndarray
    hidden: np.ndarray  # [H] hidden_dtype
    carry_req_id: int
    carry_position: int
    start_positions: np.ndarray
    block_table: np.ndarray
    append_counts: np.ndarray
    commit_starts: np.ndarray
    inherited: np.ndarray
    padded_tokens: int
    pad_tokens: int
    padded_requests: int


def _host(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else value


def prepare(steps: List[StepInputs]) -> List[FloorInputs]:
    """Convert the steps' inputs (torch tensors or numpy arrays) once, outside any
    timed loop."""
    prepared = []
    for inputs in steps:
        counts = _host(inputs.append_counts)
        prepared.append(FloorInputs(
            move_src=_host(inputs.move_src), move_dst=_host(inputs.move_dst),
            swap_src=_host(inputs.swap_src), swap_dst=_host(inputs.swap_dst),
            reset_rows=_host(inputs.reset_rows),
            hidden=inputs.hidden.numpy().reshape(-1), carry_req_id=inputs.carry_req_id,
            carry_position=inputs.carry_position,
            start_positions=_host(inputs.start_positions),
            block_table=_host(inputs.block_table), append_counts=counts,
            commit_starts=_host(inputs.commit_starts), inherited=_host(inputs.inherited),
            padded_tokens=inputs.padded_tokens,
            pad_tokens=inputs.padded_tokens - int(counts.sum()),
            padded_requests=inputs.padded_requests))
    return prepared


def floor_step(meta: MTPMetadata, view: Any, inputs: FloorInputs,
               config: StepConfig) -> None:
    """The kernels of one standard step on a direct-path ``meta`` (see the module
    docstring); ``forward_mode`` is left alone."""
    backend = meta._backend
    buffers = meta._buffers
    annotations, scratch = buffers.annotations, buffers.row_scratch
    native.rows.move_rows(annotations, inputs.move_src, inputs.move_dst, scratch)
    native.rows.swap_rows(annotations, inputs.swap_src, inputs.swap_dst, scratch)
    native.rows.reset_rows(annotations, inputs.reset_rows)
    np.copyto(buffers.chunk_boundary_hidden.numpy().reshape(-1), inputs.hidden)
    native.carry.record(meta._carry_state, inputs.carry_req_id, inputs.carry_position)
    native.carry.check_take(meta._carry_state, inputs.carry_req_id, inputs.carry_position)
    target = meta._target(view)
    count, padded = config.active, config.padded_active
    backend.begin_decode(count, inputs.start_positions, inputs.block_table)
    for _ in range(config.depths):
        backend.decode_step(target, count, padded, config.graphed)
        backend.advance_decode_step(count)
    counts, starts = inputs.append_counts, inputs.commit_starts
    native.checks.check_commit_inputs(counts, starts, True, config.block_columns,
                                       config.block_size)
    backend.commit_pass(target, counts, starts, inputs.block_table, inputs.inherited,
                        inputs.padded_tokens, inputs.pad_tokens, inputs.padded_requests,
                        inputs.padded_requests)


def _converted(name: str) -> property:
    return property(lambda self: getattr(self._step, name).numpy(),
                    doc=f"``{name}`` of the torch step, converted at this read")


def _prepared(name: str) -> property:
    return property(lambda self: getattr(self._prepared, name))


class TorchFloorInputs:
    """``FloorInputs`` read from a torch step: each index/count/table field is
    converted with ``Tensor.numpy()`` when ``floor_step`` reads it, as the public
    methods must (once per tensor argument: 11 per standard step, the table twice, as
    ``begin_decode`` and ``setup_commit_pass`` each receive it). That conversion is the
    least a torch input costs on its way to a numba kernel, so ``floor_step`` over
    these is the kernel floor for torch inputs."""

    __slots__ = ("_step", "_prepared")

    def __init__(self, step: StepInputs, prepared: FloorInputs) -> None:
        self._step, self._prepared = step, prepared

    move_src, move_dst = _converted("move_src"), _converted("move_dst")
    swap_src, swap_dst = _converted("swap_src"), _converted("swap_dst")
    reset_rows, start_positions = _converted("reset_rows"), _converted("start_positions")
    block_table, append_counts = _converted("block_table"), _converted("append_counts")
    commit_starts, inherited = _converted("commit_starts"), _converted("inherited")
    hidden, carry_req_id = _prepared("hidden"), _prepared("carry_req_id")
    carry_position, padded_tokens = _prepared("carry_position"), _prepared("padded_tokens")
    pad_tokens, padded_requests = _prepared("pad_tokens"), _prepared("padded_requests")
