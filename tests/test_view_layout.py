"""The view layout is declared once (``VIEW_FIELDS``) and used by name everywhere.

Failure story: code that reads fields by position (``arrays[:5]``, ``view[9]``) keeps
working until someone reorders the table for alignment, and then the mirror path
silently writes block ids into the position field. Here the table is reordered and
both paths must still match the reference over whole standard steps.
"""

from __future__ import annotations

import pytest
import torch

import mtpmeta.gpu_view as gpu_view
from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.bench.workload import StepConfig, make_steps, run_step

CONFIG = StepConfig(max_requests=16, block_columns=8, block_size=4, active=10,
                    prefill_tokens=12, inherited_blocks=1, moves=2, swaps=1, resets=2)
ORDERS = {
    "reversed": lambda fields: tuple(reversed(fields)),
    "request fields first": lambda fields: tuple(sorted(fields, key=lambda f: f.per_token)),
}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("path", ["direct", "mirror"])
def test_reordered_view_table_still_matches_the_reference(monkeypatch, order, path):
    original = gpu_view.VIEW_FIELDS
    monkeypatch.setattr(gpu_view, "VIEW_FIELDS", ORDERS[order](original))
    view = ContextGPUView(CONFIG.max_requests, CONFIG.max_tokens, CONFIG.block_columns)
    first = gpu_view.VIEW_FIELDS[0].name
    assert getattr(view, first).data_ptr() == view.buffer.data_ptr(), "layout follows table"
    assert first != original[0].name
    meta = MTPMetadata(**CONFIG.metadata_kwargs())
    meta.allocate("cpu", mirror=(path == "mirror"))
    ref = ReferenceMTPMetadata(**CONFIG.metadata_kwargs())
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(CONFIG.max_requests, CONFIG.max_tokens,
                                CONFIG.block_columns, "cpu")
    for inputs in make_steps(CONFIG, 4, seed=5):
        run_step(meta, view, inputs, CONFIG)
        run_step(ref, ref_view, inputs, CONFIG)
        for f in original:
            assert torch.equal(getattr(view, f.name), getattr(ref_view, f.name)), f.name


def test_no_code_indexes_view_fields_by_position():
    """A grep guard: the library reaches view fields by name only."""
    import pathlib
    import re

    root = pathlib.Path(gpu_view.__file__).parent
    pattern = re.compile(r"(arrays|tensors|staged|fields|view)\[\d|\[_WIDEST\]")
    offenders = [f"{path.name}:{number}" for path in sorted(root.glob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == []


@pytest.mark.parametrize("module", ["mtpmeta.buffers.layout", "mtpmeta.buffers.bounded_cache"])
def test_docstring_examples_hold(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted >= 1 and result.failed == 0
