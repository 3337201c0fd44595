"""Shared test helpers: building a library/reference pair and snapshotting buffers.

No numba kernels here (pytest's assert rewriting breaks numba compilation).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from mtpmeta import VIEW_FIELDS, ContextGPUView, MTPMetadata
from mtpmeta.buffers.persistent import BUFFER_NAMES
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata

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


# ------------------------------------------------------- differential driving (appended)
SCALAR_NAMES = ("forward_mode", "active_request_count", "padded_count", "graphed",
                "chunk_boundary_valid", "chunk_boundary_req_id", "chunk_boundary_position",
                "forward_active", "is_varlen_forward")


class Arg:
    """A test input as plain values plus a container form, built afresh for each side.

    container: "list" | "numpy" | "torch"; dtype: a torch dtype name ("int32", "bool",
    "bfloat16", ...); layout: "dense", "strided" (every other element of the last dim),
    "offset" (a slice ``[1:]`` of a longer array) or "transposed" (column-major 2-D).
    """

    def __init__(self, values: Any, container: str, dtype: str, layout: str = "dense",
                 shape: Any = None) -> None:
        self.values, self.container, self.dtype, self.layout = values, container, dtype, layout
        self.shape = (len(values),) if shape is None else shape

    def __repr__(self) -> str:
        return f"Arg({self.values!r}, {self.container}, {self.dtype}, {self.layout})"

    def build(self) -> Any:
        dense = torch.tensor(self.values, dtype=torch.float64).reshape(self.shape).to(
            getattr(torch, self.dtype))
        if self.container == "list" and dense.numel():
            return dense.tolist()
        if self.layout == "strided":
            wide = torch.full(dense.shape[:-1] + (2 * dense.shape[-1],), 7, dtype=dense.dtype)
            wide[..., ::2] = dense
            dense = wide[..., ::2]
        elif self.layout == "offset":
            longer = torch.full((dense.shape[0] + 1,) + dense.shape[1:], 7, dtype=dense.dtype)
            longer[1:] = dense
            dense = longer[1:]
        elif self.layout == "transposed" and dense.dim() == 2:
            dense = dense.t().contiguous().t()
        return dense.numpy() if self.container in ("numpy", "list") else dense


class Own:
    """Stands for each side's own persistent buffer ``name`` (e.g. the annotations)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Own({self.name})"


VIEW = Own("<view>")


def _alias(meta: Any, tensor: torch.Tensor) -> Any:
    """Which persistent buffer's memory ``tensor`` starts in, and where (None: none)."""
    for name in BUFFER_NAMES:
        buf = getattr(meta, name)
        if buf is not None and 0 <= tensor.data_ptr() - buf.data_ptr() < max(buf.nbytes, 1):
            return name, tensor.data_ptr() - buf.data_ptr(), tuple(tensor.shape), \
                tensor.stride()
    return None


def assert_results_equal(ours: Any, theirs: Any, lib: Any, ref: Any, what: str) -> None:
    if isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == len(theirs):
        for a, b in zip(ours, theirs):
            assert_results_equal(a, b, lib, ref, what)
    elif isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        assert torch.equal(ours.cpu(), theirs.cpu()), f"{what}: {ours} != {theirs}"
        assert _alias(lib, ours) == _alias(ref, theirs), f"{what}: returned views differ"
    else:
        assert ours == theirs, f"{what}: returned {ours!r} vs {theirs!r}"


class DifferentialPair:
    """The library object and the reference, driven with identical freshly built inputs.

    ``call`` runs one method on both sides, checks that neither mutated its inputs, then
    scribbles over those inputs (so an aliased input shows up as a difference) and
    compares results, the ten view fields, every buffer and the scalar state.
    """

    def __init__(self, path: str, *, max_tokens: int = 128, junk_seed: int = 0,
                 **overrides: Any) -> None:
        self.path, self.overrides, self.max_tokens = path, overrides, max_tokens
        self.lib, self.ref = self._fresh_lib(), make_reference(**overrides)
        self.lib_view, self.ref_view = make_views(self.lib, max_tokens)
        gen = torch.Generator().manual_seed(junk_seed)
        for f in VIEW_FIELDS:  # identical junk: a stray write or a missed one shows
            junk = torch.randint(-9, 1000, getattr(self.lib_view, f.name).shape, generator=gen)
            getattr(self.lib_view, f.name).copy_(junk)
            getattr(self.ref_view, f.name).copy_(junk)
        self.check("construction")

    def _fresh_lib(self) -> MTPMetadata:  # mirror staging sized like the view
        lib = MTPMetadata(**config(**self.overrides))
        lib.allocate("cpu", mirror=(self.path == "mirror"), max_tokens=self.max_tokens)
        return lib

    def _sides(self):
        return ((self.lib, self.lib_view), (self.ref, self.ref_view))

    @staticmethod
    def _build(arg: Any, meta: Any, view: Any, memo: Dict[int, Any]) -> Any:
        if arg is VIEW:
            return view
        if isinstance(arg, Own):
            return getattr(meta, arg.name)
        if not isinstance(arg, Arg):
            return arg
        if id(arg) not in memo:  # one Arg given twice is one object (kv is q)
            memo[id(arg)] = (arg, arg.build())
        return memo[id(arg)][1]

    def call(self, method: str, *args: Any, raises: Any = None, **kwargs: Any) -> Any:
        results = []
        for meta, view in self._sides():
            memo: Dict[int, Any] = {}
            a = [self._build(x, meta, view, memo) for x in args]
            k = {key: self._build(x, meta, view, memo) for key, x in kwargs.items()}
            if raises is not None:
                try:
                    getattr(meta, method)(*a, **k)
                except raises:
                    pass
                else:
                    raise AssertionError(f"{type(meta).__name__}.{method}: no {raises}")
            else:
                results.append(getattr(meta, method)(*a, **k))
            for arg, built in memo.values():
                fresh = arg.build()
                assert repr(built) == repr(fresh) if isinstance(built, list) else \
                    torch.equal(torch.as_tensor(built), torch.as_tensor(fresh)), \
                    f"{method} mutated its input {arg!r}"
                if not isinstance(built, list):
                    torch.as_tensor(built).fill_(3)  # a kept alias would now differ
        if raises is None:
            assert_results_equal(results[0], results[1], self.lib, self.ref, method)
        self.check(method)
        return None if raises is not None else results[0]

    def check(self, where: str) -> None:
        try:
            assert_views_equal(self.lib_view, self.ref_view)
            assert_buffers_equal(self.lib, self.ref)
            for name in SCALAR_NAMES:
                ours, theirs = getattr(self.lib, name), getattr(self.ref, name)
                assert ours == theirs, f"{name}: {ours!r} vs {theirs!r}"
            for name in ("active_offsets", "active_block_table"):
                ours, theirs = getattr(self.lib, name), getattr(self.ref, name)
                assert (ours is None) == (theirs is None), f"{name}: {ours} vs {theirs}"
                if ours is not None:
                    assert_results_equal(ours, theirs, self.lib, self.ref, name)
        except AssertionError as exc:
            raise AssertionError(f"after {where}: {exc}") from None

    def reallocate(self) -> None:
        """The suspend/resume path on both sides, checked against fresh objects."""
        self.call("deallocate")
        self.lib.allocate("cpu", mirror=(self.path == "mirror"), max_tokens=self.max_tokens)
        self.ref.allocate("cpu")
        assert_buffers_equal(self.lib, self._fresh_lib())
        assert_buffers_equal(self.ref, make_reference(**self.overrides))
        for meta in (self.lib, self.ref):
            assert meta.forward_mode.name == "NONE" and not meta.chunk_boundary_valid
            assert meta.active_offsets is None and meta.active_block_table is None
        self.check("deallocate + allocate")
