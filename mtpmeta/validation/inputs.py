"""Boundary validation: turn caller inputs into host numpy arrays and check bounds.

Every public method runs these BEFORE it writes anything, so a bad input leaves every
buffer as it was. Messages name the argument and the bound, e.g.
``"positions: block column 9 >= max_kv_block_count 8 (position 75, block_size 8)"``.
These are explicit raises, never ``assert``: they hold under ``python -O``.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple, Union

import numpy as np
import torch

from mtpmeta.buffers.layout import is_int_dtype
from mtpmeta.kernels import native
from mtpmeta.errors import InvalidDtypeError

__all__ = [
    "as_count",
    "check_flag",
    "as_host_ints",
    "as_row_indices",
    "raise_row_out_of_range",
    "is_device_tensor",
    "RowIndex",
    "as_host_counts",
    "as_host_request_ints",
    "raise_bad_count",
    "as_carry_source",
    "as_optional_per_request",
    "check_device_tensors",
    "INT32_LIMIT",
    "INT64_MAX",
]

RowIndex = Union[slice, np.ndarray]
INT32_LIMIT = 2**31  # lengths and token indices are int32 in the view
INT64_MAX = 2**63 - 1
_FAST_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_INT32, _INT64 = _FAST_DTYPES
_FAST_TORCH = (torch.int32, torch.int64)
_Tensor, _ndarray = torch.Tensor, np.ndarray
# What ``Tensor.numpy()`` raises for a tensor it cannot view (device, meta, grad,
# conj/neg bits, dtypes numpy lacks); such inputs take the checked slow path.
_NO_VIEW = (TypeError, RuntimeError, ValueError)
_first_outside = native.checks.first_outside

# The hot paths below (``as_host_ints``, ``as_row_indices``) accept exactly what the
# bench and a scheduler pass most: a plain CPU tensor or an ndarray whose numpy view is
# C-contiguous int32/int64 of the right rank. They cost one ``Tensor.numpy()`` (a torch
# tensor's only route to a numpy view; about 6k instructions, one ``aten::detach``)
# plus three attribute reads. dtypes are compared by identity: numpy's builtin int32/
# int64 descriptors are singletons, and anything else (a byte-swapped or unpickled
# dtype) simply takes the slow path, which checks and converts everything.


def is_device_tensor(value: Any, runtime: Any = None) -> bool:
    """True for a torch tensor that is not in host memory: as ``runtime.is_device``
    (``mtpmeta.buffers.device_runtime``, so a simulated device tensor counts) when one is given."""
    if not isinstance(value, torch.Tensor):
        return False
    return runtime.is_device(value) if runtime is not None else not value.is_cpu


def as_count(value: Any, name: str, *, low: int = 0, high: int | None = None,
             high_name: str = "") -> int:
    """An integer in ``[low, high]``; raises ValueError naming ``name`` and the bound."""
    if type(value) is int and value >= low and (high is None or value <= high):
        return value  # the hot path
    if isinstance(value, bool) or isinstance(value, float):
        raise InvalidDtypeError(f"{name}: expected an integer, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise InvalidDtypeError(f"{name}: expected an integer, got "
                                f"{type(value).__name__}") from None
    if count < low:
        raise ValueError(f"{name}: {count} < {low}")
    if high is not None and count > high:
        raise ValueError(f"{name}: {count} > {high_name or 'limit'} {high}")
    return count


def check_flag(value: Any, name: str) -> bool:
    """``value`` as a bool; only ``bool`` and numpy bools are flags (``"no"`` would
    read as True, ``2`` is no flag). Raises ``InvalidDtypeError`` (a TypeError)."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise InvalidDtypeError(f"{name}: expected a bool (True or False), got {value!r} "
                            f"({type(value).__name__})")


def _numpy_of(value: Any, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{name}: a meta tensor holds no data")
        if value.device.type != "cpu":
            # Documented sync: a device tensor given where host data is needed.
            value = value.cpu()
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise InvalidDtypeError(f"{name}: dtype {value.dtype} cannot be cast safely to "
                                    "an integer index/count")
        # Integer tensors cannot require grad, so .numpy() needs no detach (an op).
        return value.numpy()
    if isinstance(value, (list, tuple, range)):
        array = np.asarray(value)
        if array.size == 0:
            return np.zeros(array.shape, dtype=np.int64)
        return array
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return np.asarray(value)
    raise InvalidDtypeError(f"{name}: expected a tensor, numpy array or sequence of "
                            f"integers, got {type(value).__name__}")


def _as_fast_ints(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise InvalidDtypeError(f"{name}: dtype {array.dtype} cannot be cast safely to an "
                                "integer index/count")
    if array.dtype not in _FAST_DTYPES:
        if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name}: value {array.max()} does not fit int64")
        array = array.astype(np.int64)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def _host_view(value: Any) -> Optional[np.ndarray]:
    """The numpy view of an exact ``torch.Tensor`` in host memory or an ``ndarray`` as
    it is; None for anything else (a device or meta tensor, a sequence, a scalar)."""
    kind = type(value)
    if kind is _Tensor:
        try:
            return value.numpy()
        except _NO_VIEW:
            return None
    return value if kind is _ndarray else None


def as_host_ints(value: Any, name: str, *, ndim: int = 1) -> np.ndarray:
    """A C-contiguous int32/int64 numpy array of ``ndim`` dims (no copy when possible).

    Accepts numpy arrays, CPU or device torch tensors (a device tensor costs a sync, so
    callers route those to device ops instead), and Python sequences.
    """
    kind = type(value)  # _host_view inlined: this runs for every array argument
    if kind is _Tensor:
        try:
            array = value.numpy()
        except _NO_VIEW:
            array = None
    else:
        array = value if kind is _ndarray else None
    if array is not None:
        dtype = array.dtype
        if (dtype is _INT64 or dtype is _INT32) and array.ndim == ndim and \
                array.flags.c_contiguous:
            return array  # the hot path
    else:
        array = _numpy_of(value, name)
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array of integers, got shape "
                         f"{tuple(array.shape)}")
    return _as_fast_ints(array, name)


def _row_out_of_range(name: str, row: int, num_rows: int) -> IndexError:
    return IndexError(f"{name}: row index {row} out of range for max_requests "
                      f"{num_rows} (valid: -{num_rows} <= row < {num_rows})")


def raise_row_out_of_range(rows: np.ndarray, bad: int, num_rows: int, name: str) -> None:
    """Raise the IndexError for ``rows[bad]``, the index a ``native.rows`` kernel refused."""
    raise _row_out_of_range(name, int(rows[bad]), num_rows)


def as_row_indices(value: Any, num_rows: int, name: str) -> RowIndex:
    """Row selection in any form torch indexing takes: slice, int, sequence, numpy
    array, tensor, or a boolean mask of length ``num_rows``. Returns a slice or an int
    array. A single int is range-checked here (IndexError); an index array is checked
    against ``[-num_rows, num_rows)`` by the ``native.rows`` kernel that uses it, before
    that kernel writes anything (``raise_row_out_of_range`` turns its answer into the
    IndexError).
    """
    kind = type(value)
    if kind is slice:
        return value
    if kind is _Tensor:  # _host_view inlined
        try:
            array = value.numpy()
        except _NO_VIEW:
            array = None
    else:
        array = value if kind is _ndarray else None
    if array is not None:
        dtype = array.dtype
        if (dtype is _INT64 or dtype is _INT32) and array.ndim == 1 and \
                array.flags.c_contiguous:
            return array  # the hot path: a 1-D int32/int64 index
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        row = int(value)
        if not -num_rows <= row < num_rows:
            raise _row_out_of_range(name, row, num_rows)
        return np.array([row], dtype=np.int64)
    else:
        array = _numpy_of(value, name)
    if array.dtype == np.bool_:
        if array.shape != (num_rows,):
            raise IndexError(f"{name}: boolean mask of shape {tuple(array.shape)} does "
                             f"not match max_requests {num_rows}")
        return np.flatnonzero(array)
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D index, got shape {tuple(array.shape)}")
    return _as_fast_ints(array, name)


def as_host_counts(max_requests: int, value: Any, name: str) -> np.ndarray:
    """Per-request counts ``[P <= max_requests]``, each in ``[0, 2**31)``."""
    counts = as_host_request_ints(max_requests, value, name)
    bad = _first_outside(counts, 0, INT32_LIMIT)
    if bad >= 0:
        raise_bad_count(name, counts, bad)
    return counts


def as_host_request_ints(max_requests: int, value: Any, name: str) -> np.ndarray:
    """``as_host_counts`` without the value scan: ``[P <= max_requests]`` integers
    (for a caller whose kernel scans them, ``raise_bad_count`` naming a refusal)."""
    counts = as_host_ints(value, name)
    if len(counts) > max_requests:
        raise ValueError(f"{name}: {len(counts)} requests > max_requests "
                         f"{max_requests}")
    return counts


def raise_bad_count(name: str, counts: np.ndarray, bad: int) -> None:
    """Raise the ValueError for ``counts[bad]``, outside ``[0, 2**31)``."""
    kind = "negative count" if counts[bad] < 0 else "count beyond int32"
    raise ValueError(f"{name}: {kind} {int(counts[bad])} at index {bad}")


def as_optional_per_request(value: Any, name: str,
                            count: int) -> Optional[np.ndarray]:
    """None, or an array of at least ``count`` (the commit pass's requests) entries."""
    if value is None:
        return None
    array = as_host_ints(value, name)
    if len(array) < count:
        raise ValueError(f"{name}: {len(array)} entries < {count} requests "
                         "(append_counts)")
    return array


def check_device_tensors(device: torch.device,
                         named: Tuple[Tuple[str, Any, int], ...]) -> None:
    """Each ``(name, tensor, ndim)``: an integer tensor of ``ndim`` dims on the
    buffers' device (the device-op route takes nothing else)."""
    for name, tensor, ndim in named:
        if not isinstance(tensor, torch.Tensor) or tensor.device != device:
            got = (f"a tensor on {tensor.device}" if isinstance(tensor, torch.Tensor)
                   else f"a {type(tensor).__name__}")
            raise ValueError(f"{name}: with device inputs every input must be a "
                             f"tensor on {device}, got {got}")
        if not is_int_dtype(tensor.dtype):
            raise InvalidDtypeError(f"{name}: dtype {tensor.dtype} is not an integer "
                                    "dtype")
        if tensor.dim() != ndim:
            raise ValueError(f"{name}: expected {ndim}-D, got shape "
                             f"{tuple(tensor.shape)}")


def as_carry_source(hidden: Any, size: int, hidden_dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """``hidden`` (a floating tensor of ``size`` elements, any shape) shaped to broadcast
    into the ``[1, 1, size]`` chunk carry on ``device``, detached. A ``meta`` hidden
    holds no data: refused unless the carry is on ``meta`` too."""
    if type(hidden) is _Tensor and hidden.dtype is hidden_dtype and \
            (hidden.shape == (size,) or hidden.shape == (1, 1, size)) and \
            not hidden.requires_grad and (not hidden.is_meta or hidden.device == device):
        return hidden  # the hot path: a row of hidden states, or the carry's shape
    if not isinstance(hidden, torch.Tensor):
        try:
            hidden = torch.as_tensor(hidden)
        except (RuntimeError, TypeError, ValueError) as error:
            raise InvalidDtypeError(f"hidden: expected a tensor with hidden_size "
                                    f"{size} elements ({error})") from None
    if hidden.is_meta and device.type != "meta":
        raise ValueError(f"hidden: a meta tensor holds no data to carry into {device}")
    if not hidden.dtype.is_floating_point:
        raise InvalidDtypeError(f"hidden: dtype {hidden.dtype} is not a floating dtype "
                                f"(expected {hidden_dtype})")
    if hidden.numel() != size:
        raise ValueError(f"hidden: {hidden.numel()} elements (shape "
                         f"{tuple(hidden.shape)}), expected hidden_size {size}")
    # [H], [1, H] and [1, 1, H] (H elements, last dim H) broadcast into the buffer as
    # they are; other shapes with H elements are reshaped first.
    source = hidden if 0 < hidden.dim() <= 3 and hidden.size(-1) == size \
        else hidden.reshape(1, 1, size)
    if source.requires_grad:
        source = source.detach()  # never let the persistent buffer join a graph
    return source
