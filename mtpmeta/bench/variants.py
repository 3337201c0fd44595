"""The rows ``mtpmeta bench`` compares, and whether they agree.

A row of the bench is a :class:`Variant`: a path (the pure-torch reference, the direct
path, the mirror path), the type of its inputs (torch tensors, the seed's types, or
numpy arrays) and its draft-loop mode (eager or graphed). Before any timing the bench
runs every variant through the same steps and compares the view and the persistent
buffers with the reference (:func:`check_identical`), and the kernel floor with the
direct path (:func:`floor_matches`): a speed-up of paths that disagree means nothing.

The kernel floor (:func:`floor_step`) is the numba work of one standard step on a
direct-path ``MTPMetadata``, with the inputs converted to numpy beforehand
(:func:`floor_inputs`) and none of the public methods' validation, mode bookkeeping or
shape building: what the step costs once every wrapper is gone, so the direct path's
time over it is what its wrappers cost. It reaches into the backend, and exists only to
be measured; :class:`TorchFloorInputs` converts each torch input as it is read (the
least a torch input costs on its way to a kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from mtpmeta.gpu_view import VIEW_FIELDS, ContextGPUView
from mtpmeta.kernels import native
from mtpmeta.metadata import MTPMetadata
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.bench.workload import StepConfig, StepInputs, run_step

__all__ = ["IMPLEMENTATIONS", "INPUT_KINDS", "DRAFT_MODES", "Variant", "implementations",
           "variants", "build", "state_of", "inputs_of", "check_identical",
           "floor_matches", "FloorInputs", "TorchFloorInputs", "floor_inputs", "floor_step"]

IMPLEMENTATIONS = ("reference", "direct", "mirror")
INPUT_KINDS = ("torch", "numpy")
DRAFT_MODES = ("eager", "graphed")
#: Persistent buffers compared besides every view field.
_BUFFERS = ("request_matched_prefix_blocks", "offsets", "block_table", "query_lengths",
            "kv_lengths", "chunk_boundary_hidden")


def implementations(device: torch.device) -> Tuple[str, ...]:
    """The paths the bench compares on ``device``. The direct path needs CPU buffers
    (``allocate(..., mirror=False)`` refuses any other device), so on a GPU it is the
    reference against the mirror path."""
    return IMPLEMENTATIONS if device.type == "cpu" else ("reference", "mirror")


@dataclass(frozen=True)
class Variant:
    """One row of the table: a path, the type of its inputs, its draft-loop mode."""

    impl: str
    inputs: str = "torch"
    draft: str = "eager"

    @property
    def label(self) -> str:
        return f"{self.impl} {self.inputs} {self.draft}"

    def config(self, config: StepConfig) -> StepConfig:
        return replace(config, graphed=self.draft == "graphed")


def variants(device: torch.device) -> List[Variant]:
    """Every row, headline (torch inputs) first; the reference runs on torch inputs
    only, the seed's types, and is the baseline of both input rows."""
    return [Variant(impl, inputs, draft) for inputs in INPUT_KINDS for draft in DRAFT_MODES
            for impl in implementations(device)
            if not (impl == "reference" and inputs == "numpy")]


def build(name: str, config: StepConfig, device: torch.device):
    """``(metadata, view)`` of one implementation, allocated on ``device``."""
    if name == "reference":
        meta: Any = ReferenceMTPMetadata(**config.metadata_kwargs())
        meta.allocate(device)
        return meta, ReferenceGPUView(config.max_requests, config.max_tokens,
                                      config.block_columns, device)
    meta = MTPMetadata(**config.metadata_kwargs())
    meta.allocate(device, mirror=(name == "mirror"), max_tokens=config.max_tokens)
    return meta, ContextGPUView(config.max_requests, config.max_tokens,
                                config.block_columns, device)


def state_of(meta: Any, view: Any) -> Dict[str, torch.Tensor]:
    """CPU copies of every view field and of the persistent buffers a step writes."""
    state = {f.name: getattr(view, f.name).cpu() for f in VIEW_FIELDS}
    for name in _BUFFERS:
        state[name] = getattr(meta, name).cpu()
    return state


def inputs_of(steps: List[StepInputs]) -> Dict[str, List[StepInputs]]:
    """``steps`` by input kind: as drawn (torch tensors) and converted to numpy."""
    return {"torch": steps, "numpy": [step.as_numpy() for step in steps]}


def check_identical(config: StepConfig, steps: List[StepInputs],
                    device: torch.device) -> Optional[str]:
    """Run every variant through ``steps``; describe the first difference from the
    reference of the same draft mode."""
    by_kind = inputs_of(steps)
    for draft in DRAFT_MODES:
        rows = [v for v in variants(device) if v.draft == draft]
        runs = {v: build(v.impl, v.config(config), device) for v in rows}
        for index in range(len(steps)):
            states = {}
            for variant, (meta, view) in runs.items():
                run_step(meta, view, by_kind[variant.inputs][index], variant.config(config))
                states[variant] = state_of(meta, view)
            expected = states[Variant("reference", "torch", draft)]
            for variant, state in states.items():
                for key, value in expected.items():
                    if not torch.equal(state[key], value.to(state[key].dtype)):
                        return (f"step {index}: {variant.label} differs from the reference "
                                f"in {key}")
    return None


def floor_matches(config: StepConfig, steps: List[StepInputs]) -> bool:
    """Whether the kernel floor (:func:`floor_step`) leaves the same view and buffers as
    the full direct path over ``steps``: only then is it a bound."""
    full, full_view = build("direct", config, torch.device("cpu"))
    bare, bare_view = build("direct", config, torch.device("cpu"))
    torch_bare, torch_view = build("direct", config, torch.device("cpu"))
    for inputs, bare_inputs in zip(steps, floor_inputs(steps)):
        run_step(full, full_view, inputs, config)
        floor_step(bare, bare_view, bare_inputs, config)
        floor_step(torch_bare, torch_view, TorchFloorInputs(inputs, bare_inputs),
                         config)
    expected = state_of(full, full_view)
    return all(torch.equal(actual[key], value) for actual in (
        state_of(bare, bare_view), state_of(torch_bare, torch_view))
        for key, value in expected.items())


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


def floor_inputs(steps: List[StepInputs]) -> List[FloorInputs]:
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
