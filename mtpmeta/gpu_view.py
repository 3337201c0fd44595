"""The destination view: ten per-forward fields that the MTP writers fill.

``ContextGPUView`` mirrors upstream's view class for the fields MTP writes. Its layout is
declared once, as data (``VIEW_FIELDS``), and built as ONE contiguous ``uint8``
allocation with a typed view per field, so a snapshot or a coalesced copy of the whole
view is a single op. The writers in ``MTPMetadata`` accept any object with these ten
attributes (upstream's own view included); ``resolve_view`` checks one once and caches
what the writers need.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

from mtpmeta.errors import InvalidDtypeError
from mtpmeta.buffers.layout import dtype_range
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.layout import PackedLayout, record_type

__all__ = ["ContextGPUView", "ViewField", "VIEW_FIELDS", "ViewFields", "kernel_args",
           "view_entries"]


@dataclass(frozen=True)
class ViewField:
    """One field of the destination view: name, dtype, symbolic shape, meaning.

    Shape dims are ``"tokens"`` (max_tokens), ``"requests"`` (max_requests),
    ``"requests+1"`` (cumulative arrays) and ``"blocks"`` (max_kv_blocks).
    """

    name: str
    dtype: torch.dtype
    dims: Tuple[str, ...]
    meaning: str

    def shape(self, max_requests: Optional[int], max_tokens: int,
              max_kv_blocks: int) -> Tuple[int, ...]:
        """The field's shape; ``max_requests=None`` gives every request dim (the
        cumulative one included) length 0, for a forward without MHA metadata."""
        sizes = {
            "tokens": max_tokens,
            "requests": max_requests or 0,
            "requests+1": 0 if max_requests is None else max_requests + 1,
            "blocks": max_kv_blocks,
        }
        return tuple(sizes[d] for d in self.dims)

    @property
    def per_token(self) -> bool:
        return self.dims == ("tokens",)


# Order is layout order: the int64 field first (8-byte alignment), then the int32 token
# fields in upstream's order, then the request fields with the two lengths adjacent and
# the two cumulative arrays adjacent (so each pair is one strided group for a copy).
VIEW_FIELDS: Tuple[ViewField, ...] = (
    ViewField("token_to_pos_ids", torch.int64, ("tokens",), "RoPE position id per token"),
    ViewField("token_to_block_idx", torch.int32, ("tokens",), "KV block each token writes"),
    ViewField("token_to_local_position_within_kv_block", torch.int32, ("tokens",),
              "slot within that block"),
    ViewField("token_to_request_idx", torch.int32, ("tokens",), "owning request row"),
    ViewField("token_to_position_in_request", torch.int32, ("tokens",),
              "write position within the request"),
    ViewField("mha_query_lengths", torch.int32, ("requests",), "query rows per request"),
    ViewField("mha_kv_seq_lengths", torch.int32, ("requests",), "KV entries per request"),
    ViewField("mha_cu_query_seq_lengths", torch.int32, ("requests+1",),
              "cumulative query lengths, [0] = 0"),
    ViewField("mha_cu_kv_seq_lengths", torch.int32, ("requests+1",),
              "cumulative KV lengths, [0] = 0"),
    ViewField("mha_block_table", torch.int32, ("requests", "blocks"),
              "block ids each request reads; -1 rows are padding"),
)
# The fields by name: ``ViewFields`` holds one value per field (a tensor, an array, a
# dtype...), whatever the table's order. Code reads ``fields.mha_block_table``.
ViewFields = record_type(tuple(sorted(f.name for f in VIEW_FIELDS)))
_FIELD_NAMES = frozenset(ViewFields._fields)
_FIELD_GETTER = operator.attrgetter(*ViewFields._fields)

# The numba kernels (native/staging.py) take the view's fields as positional arguments
# in these orders: a calling convention fixed by their signatures, not a layout.
_TOKEN_ARGS = ("token_to_pos_ids", "token_to_block_idx",
               "token_to_local_position_within_kv_block", "token_to_request_idx",
               "token_to_position_in_request")
_REQUEST_ARGS = ("mha_query_lengths", "mha_kv_seq_lengths", "mha_cu_query_seq_lengths",
                 "mha_cu_kv_seq_lengths", "mha_block_table")
if set(_TOKEN_ARGS) | set(_REQUEST_ARGS) != _FIELD_NAMES:  # table/kernel drift guard
    raise RuntimeError("VIEW_FIELDS and the kernels' field arguments disagree")
_token_getter = operator.attrgetter(*_TOKEN_ARGS)
_request_getter = operator.attrgetter(*_REQUEST_ARGS)


def kernel_args(fields: Any) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """``(token_args, request_args)``: the five per-token and the five per-request
    fields of ``fields`` (anything with the field names as attributes), in the order
    the numba kernels take them."""
    return _token_getter(fields), _request_getter(fields)


def view_entries(max_requests: Optional[int], max_tokens: int, max_kv_blocks: int,
                 dtypes: Any = None) -> Tuple[Tuple[str, torch.dtype, Tuple[int, ...]], ...]:
    """``(name, dtype, shape)`` of every field in table order, for ``PackedLayout``.

    ``dtypes`` (by field name) overrides the table's dtypes, e.g. with those of a
    caller's view; ``max_requests=None`` sizes every request field 0.
    """
    return tuple((f.name, f.dtype if dtypes is None else getattr(dtypes, f.name),
                  f.shape(max_requests, max_tokens, max_kv_blocks)) for f in VIEW_FIELDS)


class ContextGPUView:
    """Destination bookkeeping views for MTP forwards, one contiguous allocation.

    Args:
        max_requests: request slots (``mha_*`` fields hold ``max_requests`` rows).
        max_tokens: token rows of the ``token_to_*`` fields.
        max_kv_blocks: block-table width.
        device: where the buffer lives.

    Attributes: the ten ``VIEW_FIELDS`` (zero-initialised views into ``buffer``).
    Assigning a field (``view.mha_block_table = t``) is allowed: it bumps
    ``field_generation``, which tells the writers to re-check the view. (Rebinding that
    bypasses ``__setattr__``, e.g. through ``__dict__``, is not seen.)
    """

    field_generation: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELD_NAMES:
            object.__setattr__(self, "field_generation", self.field_generation + 1)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _FIELD_NAMES:
            object.__setattr__(self, "field_generation", self.field_generation + 1)
        object.__delattr__(self, name)

    def __init__(self, max_requests: int, max_tokens: int, max_kv_blocks: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens),
                            ("max_kv_blocks", max_kv_blocks)):
            if int(value) < 1:
                raise ValueError(f"ContextGPUView: {name} must be >= 1, got {value}")
        self.max_requests = int(max_requests)
        self.max_tokens = int(max_tokens)
        self.max_kv_blocks = int(max_kv_blocks)
        layout = PackedLayout.build(view_entries(self.max_requests, self.max_tokens,
                                                 self.max_kv_blocks))
        # [nbytes] uint8: every field below is a typed view of this one allocation.
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        for name, view in zip(layout.names, layout.tensors(self.buffer)):
            setattr(self, name, view)

    @property
    def device(self) -> torch.device:
        """The device every field lives on (that of the one ``buffer``); the writers
        need it to equal the ``MTPMetadata``'s ``allocate`` device."""
        return self.buffer.device

    def fields(self) -> Dict[str, torch.Tensor]:
        """The ten field views by name, in layout order."""
        return {spec.name: getattr(self, spec.name) for spec in VIEW_FIELDS}

    def __repr__(self) -> str:
        return (f"ContextGPUView(max_requests={self.max_requests}, max_tokens="
                f"{self.max_tokens}, max_kv_blocks={self.max_kv_blocks}, "
                f"device={self.device})")


class ViewTarget:
    """What the writers need from one destination view, checked once.

    ``fields`` holds the ten field tensors by name (``ViewFields``); on a CPU view
    ``arrays`` holds their numpy views and ``token_arrays`` / ``request_arrays`` the
    same in the kernels' argument order (else all three are ``None``). ``max_tokens``
    is the shortest token field, ``max_requests`` the shortest request field (cu arrays
    count one less), ``width`` the block-table width. ``plans`` caches the mirror
    path's per-shape copy plans against this view, so they die with it. ``generation``
    is the view's ``field_generation`` when it is exactly a ``ContextGPUView`` (else
    None). ``token_block_range`` / ``table_block_range``: the ``(low, high)`` block ids
    ``token_to_block_idx`` / ``mha_block_table`` can hold. ``writer_scratch``: device
    scratch a device-route ``write_mha_metadata`` stages through, ``token_scratch`` the
    device-route ``write_token_maps``'s (``token_scratch.TokenScratch``), each made at
    its first use, one per view: view writers are not stream-ordered, so two views
    written on two streams never share them.
    """

    __slots__ = ("fields", "arrays", "token_arrays", "request_arrays", "max_tokens",
                 "max_requests", "width", "device", "plans", "generation",
                 "token_block_range", "table_block_range", "writer_scratch",
                 "token_scratch", "__weakref__")

    def __init__(self, gpu_view: Any) -> None:
        self.generation: Optional[int] = (gpu_view.field_generation
                                          if type(gpu_view) is ContextGPUView else None)
        tensors = {}
        for spec in VIEW_FIELDS:
            tensor = getattr(gpu_view, spec.name, None)
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"gpu_view: missing tensor field {spec.name!r} "
                                 f"(got {type(tensor).__name__})")
            if tensor.dtype.is_floating_point or tensor.dtype.is_complex or \
                    tensor.dtype == torch.bool:
                raise InvalidDtypeError(f"gpu_view.{spec.name}: dtype {tensor.dtype} is "
                                        "not an integer dtype")
            if tensor.dim() != len(spec.dims):
                raise ValueError(f"gpu_view.{spec.name}: expected {len(spec.dims)}-D, got "
                                 f"shape {tuple(tensor.shape)}")
            tensors[spec.name] = tensor
        fields = ViewFields(**tensors)
        self.fields = fields
        self.device = next(iter(tensors.values())).device
        for name, tensor in tensors.items():
            if tensor.device != self.device:
                raise ValueError(f"gpu_view.{name}: on {tensor.device}, other fields "
                                 f"on {self.device}")
        self.max_tokens = min(tensors[f.name].shape[0] for f in VIEW_FIELDS if f.per_token)
        self.max_requests = min(
            fields.mha_query_lengths.shape[0], fields.mha_kv_seq_lengths.shape[0],
            fields.mha_cu_query_seq_lengths.shape[0] - 1,
            fields.mha_cu_kv_seq_lengths.shape[0] - 1, fields.mha_block_table.shape[0])
        self.width = fields.mha_block_table.shape[1]
        # (low, high), inclusive: the block ids token_to_block_idx / mha_block_table
        # hold; the writers refuse a host block id outside them (it would wrap).
        self.token_block_range = dtype_range(fields.token_to_block_idx.dtype)
        self.table_block_range = dtype_range(fields.mha_block_table.dtype)
        self.arrays: Optional[Any] = None
        self.token_arrays: Optional[Tuple[np.ndarray, ...]] = None
        self.request_arrays: Optional[Tuple[np.ndarray, ...]] = None
        # Copy plans of the mirror path built against this view (views, never data).
        self.plans = BoundedCache(4096)
        self.writer_scratch: Optional[torch.Tensor] = None
        self.token_scratch: Optional[Any] = None  # token_scratch.TokenScratch
        if self.device.type == "cpu":
            self.arrays = ViewFields(**{name: t.numpy() for name, t in tensors.items()})
            self.token_arrays, self.request_arrays = kernel_args(self.arrays)

    def still_matches(self, gpu_view: Any) -> bool:
        """True while every field attribute is still the tensor this target was built on.

        A ``ContextGPUView`` counts its field assignments, so one integer compare does;
        any other view object has its ten attributes compared by identity.
        """
        if self.generation is not None:
            return gpu_view.field_generation == self.generation
        try:
            current = _FIELD_GETTER(gpu_view)
        except AttributeError:
            return False
        return all(map(operator.is_, current, self.fields))


class ViewCache:
    """Resolves destination views to ``ViewTarget``s, keeping the ``capacity`` most
    recently used ones (a hit moves its view to the most recent end).

    A target leaves the cache in one of three ways: evicted as the least recently used,
    replaced because its view's fields were rebound, or replaced because its view died
    and a new view got its ``id``. Each one goes through ``_drop``: a target that holds
    device scratch is handed to ``drop`` (``DeviceLifecycle.drop``) first, since work
    queued on any stream may still use that scratch (view writers are not
    stream-ordered), and inside a CUDA graph capture the lifecycle keeps it instead of
    synchronizing."""

    def __init__(self, capacity: int = 8, drop: Optional[Callable[[Any], None]] = None
                 ) -> None:
        self._capacity = capacity
        self._drop_held = drop
        self._entries: "OrderedDict[int, Tuple[weakref.ReferenceType | Any, ViewTarget]]" \
            = OrderedDict()

    def resolve(self, gpu_view: Any, accept: Any = None) -> ViewTarget:
        """The cached target of ``gpu_view``; a new one is built, passed to ``accept``
        (which may raise, leaving the cache as it was) and cached when the view is new
        or its fields were rebound."""
        key = id(gpu_view)
        entry = self._entries.get(key)
        if entry is not None:
            ref, target = entry
            owner = ref() if isinstance(ref, weakref.ReferenceType) else ref
            if owner is gpu_view and target.still_matches(gpu_view):
                self._entries.move_to_end(key)
                return target
        target = ViewTarget(gpu_view)
        if accept is not None:
            accept(target)
        if entry is not None:  # rebound fields, or a dead view's id reused
            del self._entries[key]
            self._drop(entry[1])
        elif len(self._entries) >= self._capacity:
            self._drop(self._entries.popitem(last=False)[1][1])
        try:
            ref: Any = weakref.ref(gpu_view)
        except TypeError:  # objects without __weakref__ (e.g. slotted) are held strongly
            ref = gpu_view
        self._entries[key] = (ref, target)
        return target

    def _drop(self, target: ViewTarget) -> None:
        """The one way a target leaves the cache (class docstring)."""
        if self._drop_held is not None and (target.writer_scratch is not None or
                                            target.token_scratch is not None):
            self._drop_held(target)

    def clear(self) -> None:
        for _, target in self._entries.values():
            self._drop(target)
        self._entries.clear()
