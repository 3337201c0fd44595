"""Shared test helpers: building a library/reference pair and snapshotting buffers.

No numba kernels here (pytest's assert rewriting breaks numba compilation).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from mtpmeta import VIEW_FIELDS, ContextGPUView, MTPMetadata
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata

BUFFER_NAMES = (
    "request_matched_prefix_blocks",
    "offsets",
    "block_table",
    "query_lengths",
    "kv_lengths",
    "row_ids",
    "chunk_boundary_hidden",
)
PATHS = ("direct", "mirror")


def config(**overrides: Any) -> Dict[str, Any]:
    """Constructor keywords of a small, block-boundary-friendly geometry."""
    kwargs = dict(enabled=True, max_requests=8, max_kv_block_count=6, block_size_tokens=4,
                  dummy_block_idx=999, block_table_dtype=torch.int32, hidden_size=8,
                  hidden_dtype=torch.float32)
    kwargs.update(overrides)
    return kwargs


def make_metadata(path: str = "direct", **overrides: Any) -> MTPMetadata:
    """An allocated library object on the CPU, on the given path."""
    meta = MTPMetadata(**config(**overrides))
    meta.allocate("cpu", mirror=(path == "mirror"))
    return meta


def make_reference(**overrides: Any) -> ReferenceMTPMetadata:
    ref = ReferenceMTPMetadata(**config(**overrides))
    ref.allocate("cpu")
    return ref


def make_views(meta_or_kwargs: Any, max_tokens: int = 64):
    """A (library ContextGPUView, ReferenceGPUView) pair sized like ``meta``."""
    R = meta_or_kwargs.max_requests
    W = meta_or_kwargs.max_kv_block_count
    return ContextGPUView(R, max_tokens, W, "cpu"), ReferenceGPUView(R, max_tokens, W, "cpu")


def view_state(view: Any) -> Dict[str, torch.Tensor]:
    """Clones of the ten destination fields."""
    return {f.name: getattr(view, f.name).clone() for f in VIEW_FIELDS}


def buffer_state(meta: Any) -> Dict[str, Any]:
    """Clones of every persistent buffer plus the scalar state of ``meta``."""
    state: Dict[str, Any] = {}
    for name in BUFFER_NAMES:
        tensor = getattr(meta, name)
        state[name] = None if tensor is None else tensor.clone()
    for name in ("forward_mode", "active_request_count", "padded_count", "graphed",
                 "chunk_boundary_valid", "chunk_boundary_req_id", "chunk_boundary_position"):
        state[name] = getattr(meta, name)
    return state


def assert_same_state(before: Dict[str, Any], after: Dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{key} changed"
        else:
            assert value == other, f"{key} changed: {value!r} -> {other!r}"


def assert_views_equal(ours: Any, theirs: Any) -> None:
    for f in VIEW_FIELDS:
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        assert torch.equal(a.cpu(), b.cpu().to(a.dtype)), (
            f"{f.name} differs:\nours   {a}\ntheirs {b}")


def assert_buffers_equal(meta: Any, ref: Any) -> None:
    for name in BUFFER_NAMES:
        a, b = getattr(meta, name), getattr(ref, name)
        if a is None or b is None:
            assert a is None and b is None, f"{name}: {a} vs {b}"
            continue
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs:\nours   {a}\ntheirs {b}"


# --- added for the SPEC tests (test_spec_*.py, test_bad_input.py) -----------------------
SENTINEL = 777  # a value no writer produces in the hand-worked examples


def namespace_view(max_requests: int, max_tokens: int, max_kv_blocks: int,
                   fill: int = 0) -> Any:
    """A bare object holding the ten destination fields as ten separate tensors."""
    from types import SimpleNamespace

    fields = {}
    for f in VIEW_FIELDS:
        shape = f.shape(max_requests, max_tokens, max_kv_blocks)
        fields[f.name] = torch.full(shape, fill, dtype=f.dtype)
    return SimpleNamespace(**fields)


def fill_view(view: Any, value: int = SENTINEL) -> Any:
    """Set every element of the ten destination fields to ``value``; returns ``view``."""
    for f in VIEW_FIELDS:
        getattr(view, f.name).fill_(value)
    return view


def make_view(kind: str, max_requests: int = 8, max_tokens: int = 16,
              max_kv_blocks: int = 6, fill: int = SENTINEL) -> Any:
    """A sentinel-filled destination view: ``"context"`` (the library's one-buffer
    ContextGPUView), ``"reference"`` (ReferenceGPUView) or ``"namespace"``."""
    if kind == "context":
        view = ContextGPUView(max_requests, max_tokens, max_kv_blocks, "cpu")
    elif kind == "reference":
        view = ReferenceGPUView(max_requests, max_tokens, max_kv_blocks, "cpu")
    elif kind == "namespace":
        view = namespace_view(max_requests, max_tokens, max_kv_blocks)
    else:
        raise ValueError(f"unknown view kind {kind!r}")
    return fill_view(view, fill)


def field(view: Any, name: str) -> list:
    """A destination field as a (nested) Python list, for comparing with hand-worked values."""
    return getattr(view, name).tolist()
