"""What ``mtpmeta bench`` compares, and whether the compared paths agree.

A row of the bench is a :class:`Variant`: a path (the pure-torch reference, the direct
path, the mirror path), the type of its inputs (torch tensors, the seed's types, or
numpy arrays) and its draft-loop mode (eager or graphed). Before any timing the bench
runs every variant through the same steps and compares the view and the persistent
buffers with the reference (:func:`check_identical`), and the kernel floor with the
direct path (:func:`floor_matches`): a speed-up of paths that disagree means nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import floor
from mtpmeta.gpu_view import VIEW_FIELDS, ContextGPUView
from mtpmeta.metadata import MTPMetadata
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.bench.workload import StepConfig, StepInputs, run_step

__all__ = ["IMPLEMENTATIONS", "INPUT_KINDS", "DRAFT_MODES", "Variant", "implementations",
           "variants", "build", "state_of", "inputs_of", "check_identical",
           "floor_matches"]

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
    """Whether the kernel floor (``mtpmeta.bench.floor``) leaves the same view and buffers as
    the full direct path over ``steps``: only then is it a bound."""
    full, full_view = build("direct", config, torch.device("cpu"))
    bare, bare_view = build("direct", config, torch.device("cpu"))
    torch_bare, torch_view = build("direct", config, torch.device("cpu"))
    for inputs, bare_inputs in zip(steps, floor.prepare(steps)):
        run_step(full, full_view, inputs, config)
        floor.floor_step(bare, bare_view, bare_inputs, config)
        floor.floor_step(torch_bare, torch_view, floor.TorchFloorInputs(inputs, bare_inputs),
                         config)
    expected = state_of(full, full_view)
    return all(torch.equal(actual[key], value) for actual in (
        state_of(bare, bare_view), state_of(torch_bare, torch_view))
        for key, value in expected.items())
