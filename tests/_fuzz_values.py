"""Value strategies for ``test_fuzz_bad_input.py``: valid integers in every form the
library takes, and bad values (wrong types, dtypes, shapes, ranges, views).

Geometry (``helpers.config``): R = 8 request rows, W = 6 block columns, BS = 4 tokens a
block, H = 8 hidden elements; fuzzed views hold TOKENS = 16 token rows, R requests, W
columns. No numba kernels here (pytest's assert rewriting breaks numba compilation).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, List, Tuple

import numpy as np
import torch
from hypothesis import strategies as st

from mtpmeta import VIEW_FIELDS
from tests.helpers import SENTINEL

R, W, BS, H = 8, 6, 4, 8
TOKENS = 16  # token rows of a fuzzed view
LIMIT = W * BS  # first position whose block column is W
INT32_MAX = 2**31 - 1  # lengths, counts and token indices are int32 in the view
INT64_MAX = 2**63 - 1


def in_int64(value: int) -> bool:
    return -2**63 <= value <= INT64_MAX


# ---------------------------------------------------------------------------- views
def namespace_view(requests: int = R, tokens: int = TOKENS, width: int = W,
                   strided: bool = False) -> SimpleNamespace:
    """Ten separate sentinel-filled fields; ``strided``: each 1-D field every other
    element of a wider tensor, the block table a transposed one."""
    fields = {}
    for f in VIEW_FIELDS:
        shape = f.shape(requests, tokens, width)
        if not strided:
            fields[f.name] = torch.full(shape, SENTINEL, dtype=f.dtype)
        elif len(shape) == 1:
            fields[f.name] = torch.full(shape + (2,), SENTINEL, dtype=f.dtype)[:, 0]
        else:
            fields[f.name] = torch.full(shape[::-1], SENTINEL, dtype=f.dtype).t()
    return SimpleNamespace(**fields)


def view_kinds(need_tokens: int = 0, need_requests: int = 0,
               width_checked: bool = True) -> List[str]:
    """The kinds of ``bad_view`` that are bad for a call needing that much room."""
    kinds = ["junk", "dict", "missing", "dtype", "ndim", "meta-field", "meta"]
    kinds += ["width"] if width_checked else []
    kinds += ["few-tokens"] if need_tokens else []
    kinds += ["few-requests"] if need_requests else []
    return kinds


@st.composite
def bad_view(draw, kind: str, need_tokens: int = 0, need_requests: int = 0):
    """A destination view no writer may accept (``kind`` from ``view_kinds``)."""
    if kind == "junk":
        return draw(st.sampled_from([None, "view", 7, object(), {}]))
    if kind == "few-tokens":
        return namespace_view(tokens=draw(st.integers(0, need_tokens - 1)))
    if kind == "few-requests":
        return namespace_view(requests=draw(st.integers(0, need_requests - 1)))
    if kind == "width":
        return namespace_view(width=draw(st.sampled_from([0, 1, W - 1, W + 1, W + 2])))
    view = namespace_view(strided=draw(st.booleans()))
    name = draw(st.sampled_from([f.name for f in VIEW_FIELDS]))
    field = getattr(view, name)
    if kind == "missing":
        delattr(view, name)
    elif kind == "dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bool,
                                      torch.complex64]))
        setattr(view, name, field.to(dtype))
    elif kind == "ndim":
        fewer = field.reshape(-1)[0] if field.dim() == 1 else field.reshape(-1)
        setattr(view, name, field.unsqueeze(0) if draw(st.booleans()) else fewer)
    elif kind == "meta-field":  # one field on another device than the others
        setattr(view, name, field.to("meta"))
    elif kind == "meta":  # every field on another device than the buffers
        view = SimpleNamespace(**{f.name: getattr(view, f.name).to("meta")
                                  for f in VIEW_FIELDS})
    return vars(view) if kind == "dict" else view


# ------------------------------------------------------------------- valid integers
def ints(draw, size: int, low: int, high: int) -> np.ndarray:
    return np.array(draw(st.lists(st.integers(low, high), min_size=size, max_size=size)),
                    dtype=np.int64)


def table(draw, rows: int, width: int) -> np.ndarray:
    """Block ids in int32 range; sometimes all rows alike (so a broadcast form exists)."""
    if rows and draw(st.booleans()):
        return np.repeat(ints(draw, width, 0, 2**31 - 1)[None, :], rows, axis=0)
    return ints(draw, rows * width, 0, 1000).reshape(rows, width)


def _dtypes_for(values: np.ndarray) -> List[type]:
    """Integer numpy dtypes that hold every value (int16/uint8 get widened by the library)."""
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    return [dtype for dtype in (np.int64, np.int32, np.int16, np.uint8)
            if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max]


def _strided_numpy(draw, array: np.ndarray) -> np.ndarray:
    options = ["every-other", "reversed"] + (["fortran"] if array.ndim == 2 else [])
    if array.shape[0] and (array == array[:1]).all():
        options.append("broadcast")
    how = draw(st.sampled_from(options))
    if how == "every-other":
        return np.stack([array, np.ones_like(array)], axis=-1)[..., 0]
    if how == "reversed":  # negative strides (torch cannot even wrap these)
        return np.ascontiguousarray(array[..., ::-1])[..., ::-1]
    if how == "fortran":
        return np.asfortranarray(array)
    return np.broadcast_to(array[:1], array.shape)  # stride 0, read-only


def _strided_torch(draw, array: np.ndarray) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))
    options = ["every-other"] + (["transposed"] if array.ndim == 2 else [])
    if array.shape[0] and (array == array[:1]).all():
        options.append("broadcast")
    how = draw(st.sampled_from(options))
    if how == "every-other":  # t[::2] of an interleaved tensor
        return torch.stack([tensor, torch.ones_like(tensor)], dim=-1)[..., 0]
    if how == "transposed":
        return tensor.t().contiguous().t()
    return tensor[:1].expand(tensor.shape)  # stride 0


@st.composite
def container(draw, values: np.ndarray, strided=None):
    """``values`` (int64 or bool) as a list, tuple, numpy array or tensor of a dtype that
    holds them; ``strided`` True: a non-contiguous one, False: a contiguous one."""
    kinds = []
    if strided is not True:
        kinds += ["numpy", "torch"]
        if values.ndim == 1 or (values.shape[0] and values.shape[1]):
            kinds += ["list", "tuple"]  # an empty 2-D list would lose its width
    if strided is not False:
        kinds += ["numpy-strided", "torch-strided"]
    kind = draw(st.sampled_from(kinds))
    if kind == "list":
        return values.tolist()
    if kind == "tuple":
        nested = values.tolist()
        return tuple(map(tuple, nested)) if values.ndim == 2 else tuple(nested)
    # Strided inputs stay int64: the library copies them contiguous whatever their dtype,
    # and every int32/int64 mix would cost the strided-view kernels another numba compile.
    dtype = np.bool_ if values.dtype == np.bool_ else np.int64 if strided else \
        draw(st.sampled_from(_dtypes_for(values)))
    array = values.astype(dtype)
    if kind == "numpy":
        return array
    if kind == "torch":
        return torch.from_numpy(array)
    if kind == "numpy-strided":
        return _strided_numpy(draw, array)
    return _strided_torch(draw, array)


@st.composite
def scalar(draw, value: int):
    """An integer in one of the forms ``operator.index`` takes."""
    forms: List[Callable[[int], Any]] = [int]
    if in_int64(value):
        forms += [np.int64, torch.tensor]
    if -2**31 <= value < 2**31:
        forms.append(np.int32)
    return draw(st.sampled_from(forms))(value)


@st.composite
def index(draw, length=None, strided=None):
    """A valid row selection: slice, int, rows in [-R, R) or a boolean mask of length R.
    ``length`` fixes how many rows it selects; ``strided`` as in ``container``."""
    fits = length is None or length <= R
    kinds = ["rows"] + (["mask"] if fits else [])
    if strided is not True:
        kinds += (["slice"] if fits else []) + (["int"] if length in (None, 1) else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "slice":
        if length is None:
            bound = st.none() | st.integers(-R - 2, R + 2)
            step = st.sampled_from([None, 1, 2, 3, -1, -2, -3])
            return slice(draw(bound), draw(bound), draw(step))
        start = draw(st.integers(0, R - length))
        return slice(start, start + length)
    if kind == "int":
        return draw(scalar(draw(st.integers(-R, R - 1))))
    if kind == "mask":
        count = draw(st.integers(0, R)) if length is None else length
        mask = np.zeros(R, dtype=np.bool_)
        mask[draw(st.permutations(range(R)))[:count]] = True
        return draw(container(mask, strided))
    size = draw(st.integers(0, 10)) if length is None else length
    return draw(container(ints(draw, size, -R, R - 1), strided))


def index_length(selection: Any) -> int:
    """How many rows a valid selection from ``index`` selects."""
    if isinstance(selection, slice):
        return len(range(R)[selection])
    array = np.asarray(selection)
    if array.dtype == np.bool_:
        return int(array.sum())
    return array.size if array.ndim else 1


def other_length(draw, length: int, top: int) -> int:
    """A length in ``[0, top]`` other than ``length`` (no filter: nothing to retry)."""
    other = draw(st.integers(0, top - 1))
    return other + (other >= length)


# ---------------------------------------------------------------------- bad values
# Objects that are no integer and no integer array anywhere.
JUNK = (None, "3", b"\x03", 3.5, float("nan"), 2 + 1j, object(), {"rows": 1}, {1, 2},
        True, False, np.float64(1.0), np.bool_(True))
JUNK_COUNTS = JUNK + ([2], torch.tensor(2.0), np.float32(2.0))


def beyond(low: int, high: int, past_int64: bool = True):
    """Integers outside ``[low, high]``: near it and far off (past int64 unless told)."""
    top, bottom = (2**70, -2**70) if past_int64 else (INT64_MAX, -2**63)
    return st.integers(high + 1, high + 40) | st.integers(high + 1, top) | \
        st.integers(low - 40, low - 1) | st.integers(bottom, low - 1)


@st.composite
def bad_count(draw, low: int, high=None, none_ok: bool = False):
    """A count outside ``[low, high]`` (``high`` None: unbounded) or no integer at all."""
    options = [st.sampled_from([j for j in JUNK_COUNTS if not (none_ok and j is None)]),
               st.integers(-2**70, low - 1) | st.integers(low - 40, low - 1)]
    if high is not None:
        options.append(st.integers(high + 1, high + 40) | st.integers(high + 1, 2**70))
    value = draw(st.one_of(options))
    if isinstance(value, int) and not isinstance(value, bool) and in_int64(value):
        return draw(scalar(value))
    return value


@st.composite
def float_array(draw, shape: Tuple[int, ...], masks_ok: bool = True):
    """An array of ``shape`` whose dtype is no integer one (float, complex, bool);
    ``masks_ok`` False where a boolean array would be a valid mask."""
    kinds = ["float32", "float64", "float16", "bfloat16", "complex64", "np-float64",
             "np-float32", "np-complex128", "strided-float"]
    size = int(np.prod(shape))
    kinds += ["list-float"] if size else []  # [] is an empty integer list
    if masks_ok:
        kinds += ["bool", "np-bool"] + (["list-bool"] if size else [])
    kind = draw(st.sampled_from(kinds))
    values = np.arange(size, dtype=np.float64).reshape(shape) + 0.5
    if kind == "list-float":
        return values.tolist()
    if kind == "list-bool":
        return (values > 1).tolist()
    if kind.startswith("np-"):
        return values.astype(kind[3:])
    if kind == "strided-float":
        return torch.from_numpy(np.stack([values, values], -1))[..., 0]
    tensor = torch.from_numpy(values)
    return tensor.bool() if kind == "bool" else tensor.to(getattr(torch, kind))


@st.composite
def object_like(draw, ndim: int):
    """Sequences numpy cannot turn into an integer array (None, strings, ragged, huge)."""
    flat = draw(st.sampled_from([[1, None], ["1", "2"], [[1, 2], [3]], [2**70, 1],
                                 np.array([1, "a"], dtype=object), np.array(["1", "2"])]))
    nested = ndim == 2 and isinstance(flat, list) and not isinstance(flat[0], list)
    return [flat] if nested else flat


ARRAY_KINDS = ("junk", "dtype", "ndim", "object", "uint64", "meta")


@st.composite
def bad_array(draw, shape: Tuple[int, ...], optional: bool = False):
    """Bad input for an integer array of ``shape`` (1-D or 2-D), whatever the rest of the
    call; ``optional``: None would be valid, so it is not drawn."""
    ndim = len(shape)
    kind = draw(st.sampled_from(ARRAY_KINDS))
    if kind == "junk":
        return draw(st.sampled_from([j for j in JUNK + (3,) if not (optional and j is None)]))
    if kind == "dtype":
        return draw(float_array(shape))
    if kind == "ndim":
        wrong = draw(st.sampled_from([(), (2,) * (ndim + 1), (3,) if ndim == 2 else (2, 3)]))
        if not wrong:
            return draw(st.sampled_from([np.int64(1), torch.tensor(1), np.array(1)]))
        return draw(container(np.ones(wrong, dtype=np.int64), False))
    if kind == "object":
        return draw(object_like(ndim))
    if kind == "meta":  # right shape and dtype, no data to read
        return torch.zeros(shape, dtype=torch.int64, device="meta")
    big = np.zeros(shape if int(np.prod(shape)) else (1,) * ndim, dtype=np.uint64)
    big.flat[draw(st.integers(0, big.size - 1))] = draw(st.integers(2**63, 2**64 - 1))
    return big  # does not fit int64


INDEX_KINDS = ("int", "in-array", "uint64", "mask", "2-D", "dtype", "junk", "object",
               "slice", "meta")


@st.composite
def bad_index(draw, kind=None):
    """A row selection out of range for R rows, or no row selection at all (``kind``
    from ``INDEX_KINDS``, None: any)."""
    kind = kind or draw(st.sampled_from(INDEX_KINDS))
    if kind == "meta":
        return torch.zeros(2, dtype=torch.int64, device="meta")
    if kind == "int":
        value = draw(beyond(-R, R - 1))
        return draw(scalar(value)) if in_int64(value) else value
    if kind == "in-array":
        rows = ints(draw, draw(st.integers(1, 6)), -R, R - 1)
        rows[draw(st.integers(0, rows.size - 1))] = draw(beyond(-R, R - 1, False))
        return draw(container(rows))
    if kind == "uint64":
        return np.array([1, draw(st.integers(2**63, 2**64 - 1))], dtype=np.uint64)
    if kind == "mask":
        shape = draw(st.sampled_from([(n,) for n in range(3 * R) if n != R] + [(2, R), ()]))
        if not shape:
            return torch.tensor(True)
        if shape == (0,):  # as a list it would be [], an empty (valid) integer selection
            return draw(st.sampled_from([np.zeros(0, np.bool_), torch.zeros(0, dtype=torch.bool)]))
        return draw(container(np.ones(shape, dtype=np.bool_), False))
    if kind == "2-D":
        return draw(container(ints(draw, 4, -R, R - 1).reshape(2, 2)))
    if kind == "dtype":
        return draw(float_array((draw(st.integers(0, 4)),), masks_ok=False))
    if kind == "junk":
        return draw(st.sampled_from(JUNK))
    if kind == "object":
        return draw(object_like(1))
    return draw(st.sampled_from([slice(None, None, 0), slice(0.5, 3), slice("a", None),
                                 slice(None, 3.0), slice(1, 2, 0.5)]))
