"""The shared half of the validation layer (``mtpmeta.validation.checks`` is the per-entry-point
half): the kernels' status codes and their decoders, the block-id range checks, and the
destination-view bounds (capacity, width, padding) that several ``check_*`` share.

Every function here raises (``ValueError``/``IndexError`` naming the argument, the
entry and the bound) or returns nothing; the decoders turn a kernel's refusal into the
caller's message, after the kernel wrote nothing. Explicit raises, never ``assert``.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Tuple

import numpy as np
from torch import Tensor

from mtpmeta.kernels import native
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.validation.geometry import Geometry
from mtpmeta.validation.inputs import INT64_MAX, as_count, raise_bad_count

__all__ = ["TokenStatus", "CarryStatus", "check_padded", "check_rows_fit",
           "refuse_whole_annotations"]

_first_outside_closed = native.checks.first_outside_closed


@enum.unique
class TokenStatus(enum.IntEnum):
    """Codes of ``native.checks.check_token_inputs`` / ``check_commit_inputs`` (the
    kernels return the plain ints, numba has no enums; these are the same values)."""

    OK = native.staging.TOKENS_OK
    ROW_OUT_OF_TABLE = native.staging.ROW_OUT_OF_TABLE
    ROW_OUT_OF_INHERITED = native.staging.ROW_OUT_OF_INHERITED
    NEGATIVE_POSITION = native.staging.NEGATIVE_POSITION
    BLOCK_COLUMN_TOO_LARGE = native.staging.BLOCK_COLUMN_TOO_LARGE
    NEGATIVE_COUNT = native.staging.NEGATIVE_COUNT


@enum.unique
class CarryStatus(enum.IntEnum):
    """Codes of ``native.carry.check_take`` (the same values as its constants)."""

    OK = native.carry.CARRY_OK
    NOT_VALID = native.carry.CARRY_NOT_VALID
    OTHER_REQUEST = native.carry.CARRY_OTHER_REQUEST
    OTHER_POSITION = native.carry.CARRY_OTHER_POSITION


# The fast paths test ``if code:``: OK must be the only falsy code.
if TokenStatus.OK != 0 or CarryStatus.OK != 0:
    raise ImportError("mtpmeta.validation.bounds: a kernel's OK status code is not 0")


# ------------------------------------------------------------ status decoders
def _raise_commit_status(geo: Geometry, code: int, r: int, counts: np.ndarray,
                         starts: Optional[np.ndarray], columns: int) -> None:
    if code == TokenStatus.NEGATIVE_COUNT:  # outside [0, 2**31)
        raise_bad_count("append_counts", counts, r)
    if code == TokenStatus.NEGATIVE_POSITION:
        raise ValueError(f"start_positions: negative position {int(starts[r])} "
                         f"at index {r}")
    if code == TokenStatus.BLOCK_COLUMN_TOO_LARGE:
        start = 0 if starts is None else int(starts[r])
        _check_block_column(geo, f"start_positions/append_counts (request {r})",
                            start + int(counts[r]) - 1, columns)


def _raise_token_status(geo: Geometry, code: int, t: int, rows: np.ndarray,
                        positions: np.ndarray, table: np.ndarray,
                        inherited: Optional[np.ndarray], columns: int) -> None:
    if code == TokenStatus.ROW_OUT_OF_TABLE:
        raise IndexError(f"rows: row {int(rows[t])} (token {t}) out of range for "
                         f"block_table with {table.shape[0]} rows")
    if code == TokenStatus.ROW_OUT_OF_INHERITED:
        raise IndexError(f"rows: row {int(rows[t])} (token {t}) out of range for "
                         f"inherited_blocks with {inherited.shape[0]} entries")
    if code == TokenStatus.NEGATIVE_POSITION:
        raise ValueError(f"positions: negative position {int(positions[t])} "
                         f"(token {t})")
    _check_block_column(geo, f"positions (token {t})", int(positions[t]), columns)


# ------------------------------------------------------------------- block ids
# check_rows_fit's free case (an int32 table, bounds that hold every int32) is also
# tested inline, with these, by the begin and commit checks (checks.py), every call.
_INT32_DTYPE = np.dtype(np.int32)
_INT32_MIN, _INT32_MAX, _INT64_MIN = -2**31, 2**31 - 1, -2**63


def check_rows_fit(table: np.ndarray, rows: int, bounds: Tuple[int, int], name: str,
                   what: str, dtype: Any, counts: Optional[np.ndarray] = None) -> None:
    """Every entry of ``table[:rows]`` (C-contiguous int32/int64 [B, W], as the input
    converters return) lies in ``bounds``, the values ``dtype`` (named ``what`` in the
    message, e.g. ``"gpu_view.mha_block_table dtype"``) holds; a ValueError naming the
    entry, its value and the dtype otherwise. Free when the source dtype fits: an int32
    table into an int32 or int64 destination is never scanned (and the message is
    built only on a refusal: formatting a dtype costs more than the check). With
    ``counts`` (the opt-in block counts) only row ``i``'s columns ``[:counts[i]]`` are
    read."""
    low, high = bounds
    if table.dtype is _INT32_DTYPE:
        if low <= _INT32_MIN and high >= _INT32_MAX:
            return
    elif low <= _INT64_MIN and high >= INT64_MAX:
        return
    if counts is None:
        return _scan_rows_fit(table, rows, bounds, name, what, dtype)
    row, column = native.checks.first_counted_outside(table, rows, counts, low, high)
    if row >= 0:
        _raise_unfit(table, row, column, bounds, name, what, dtype)


def _scan_rows_fit(table: np.ndarray, rows: int, bounds: Tuple[int, int], name: str,
                   what: str, dtype: Any) -> None:
    low, high = bounds
    flat = table[:rows].reshape(-1)
    bad = _first_outside_closed(flat, low, high)
    if bad >= 0:
        row, column = divmod(bad, table.shape[1])
        _raise_unfit(table, row, column, bounds, name, what, dtype)


def _raise_unfit(table: np.ndarray, row: int, column: int, bounds: Tuple[int, int],
                 name: str, what: str, dtype: Any) -> None:
    low, high = bounds
    raise ValueError(f"{name}: block id {int(table[row, column])} at [{row}, {column}] "
                     f"does not fit {what} {dtype} (range [{low}, {high}]); it would "
                     "wrap around into another block")


def refuse_whole_annotations(method: str, inherited: Any, annotations: Tensor,
                             offset: int) -> None:
    """Refuse ``inherited_blocks`` that is the annotation buffer from its element 0
    (``request_matched_prefix_blocks`` itself, or a view or ``.numpy()`` of it starting
    there) while ``draft_annotation_offset`` says ``offset > 0`` paused rows come first:
    entry ``r`` would then be paused row ``r``'s count, not active row ``offset + r``'s,
    and a token of an inherited block would overwrite that shared block. Called only
    when ``offset`` is non-zero; a ``ValueError`` before anything is written."""
    if isinstance(inherited, Tensor):
        address = inherited.data_ptr() if inherited.device == annotations.device else 0
    elif isinstance(inherited, np.ndarray):
        address = inherited.__array_interface__["data"][0]
    else:
        return
    if inherited.ndim == 1 and inherited.shape[0] and address == annotations.data_ptr():
        raise ValueError(
            f"{method}: inherited_blocks is request_matched_prefix_blocks from row 0, "
            f"but draft_annotation_offset = {offset} says the first {offset} rows are "
            f"paused: pass the active slice request_matched_prefix_blocks[{offset}:total] "
            f"(entry r is active row {offset} + r), or set "
            f"draft_annotation_offset = 0 first if no row is paused now")


def _raise_inherited_range(geo: Geometry, inherited: np.ndarray, index: int) -> None:
    """``inherited[index]`` lies outside ``[0, W]``: a request inherits at most its
    whole block table."""
    raise ValueError(f"inherited_blocks: {int(inherited[index])} at index {index} "
                     f"outside [0, max_kv_block_count {geo.max_kv_block_count}]")


def _raise_written_block(name: str, block: int, row: int, column: int, writer: str,
                         target: ViewTarget) -> None:
    """The block at ``[row, column]`` that ``writer`` writes is negative or does not
    fit ``token_to_block_idx``."""
    if block < 0:
        raise ValueError(f"{name}: block {block} at [{row}, {column}] is negative (an "
                         f"unallocated block), but {writer} writes into it; allocate "
                         "the block before the forward that writes it")
    dtype = target.fields.token_to_block_idx.dtype
    raise ValueError(f"{name}: block id {block} at [{row}, {column}], written by "
                     f"{writer}, does not fit gpu_view.token_to_block_idx dtype {dtype} "
                     f"(max {target.token_block_range[1]}); it would wrap around into "
                     "another block")


# --------------------------------------------------------------------- helpers
def check_padded(value: Any, name: str, count: int, what: str, *,
                 high: Optional[int] = None, high_name: str = "") -> int:
    """``value`` as a count in ``[count, high]``: padding never below what it pads.

    ``what`` names the count in the message, e.g. ``"number of tokens {count}"``.
    """
    padded = as_count(value, name, high=high, high_name=high_name)
    if padded < count:
        raise ValueError(f"{name}: {padded} < " + what.format(count=count))
    return padded


def _check_block_column(geo: Geometry, name: str, position: int,
                        columns: Optional[int] = None) -> None:
    columns = geo.max_kv_block_count if columns is None else columns
    column = position // geo.block_size_tokens
    if column >= columns:
        bound = ("max_kv_block_count" if columns == geo.max_kv_block_count
                 else "block_table width")
        raise ValueError(f"{name}: block column {column} >= {bound} {columns} "
                         f"(position {position}, block_size {geo.block_size_tokens})")


def _check_view_capacity(target: ViewTarget, *, tokens: int = 0,
                         requests: int = 0) -> None:
    if tokens > target.max_tokens:
        raise ValueError(f"padded token count {tokens} > max_tokens "
                         f"{target.max_tokens} of gpu_view{_shortest_token_field(target)}")
    if requests > target.max_requests:
        raise ValueError(f"padded request count {requests} > max_requests "
                         f"{target.max_requests} of gpu_view"
                         f"{_shortest_request_field(target)}")


def _check_view_width(target: ViewTarget, width: int, name: str) -> None:
    if width != target.width:
        raise ValueError(f"{name} {width} != gpu_view.mha_block_table width "
                         f"{target.width}")


def _shortest_token_field(target: ViewTarget) -> str:
    """`` (gpu_view.F holds N rows, fewer than the view's other token fields)`` when one
    token field is shorter than the others (a field rebound to a short tensor), else
    empty: the message then names the field to fix, not the forward's counts."""
    lengths = {name: getattr(target.fields, name).shape[0] for name in _TOKEN_FIELDS}
    if len(set(lengths.values())) == 1:
        return ""
    name = min(lengths, key=lengths.get)
    return (f" (gpu_view.{name} holds {lengths[name]} rows, fewer than the other token "
            "fields: was it replaced by a shorter tensor?)")


def _shortest_request_field(target: ViewTarget) -> str:
    """The same for the request fields (a cumulative field counts one row less)."""
    lengths = {name: getattr(target.fields, name).shape[0] - name.startswith("mha_cu_")
               for name in _REQUEST_FIELDS}
    if len(set(lengths.values())) == 1:
        return ""
    name = min(lengths, key=lengths.get)
    return (f" (gpu_view.{name} holds {lengths[name]} request rows, fewer than the "
            "other request fields: was it replaced by a shorter tensor?)")


_TOKEN_FIELDS = ("token_to_pos_ids", "token_to_block_idx",
                 "token_to_local_position_within_kv_block", "token_to_request_idx",
                 "token_to_position_in_request")
_REQUEST_FIELDS = ("mha_query_lengths", "mha_kv_seq_lengths", "mha_cu_query_seq_lengths",
                   "mha_cu_kv_seq_lengths", "mha_block_table")


def _padded_tokens(target: ViewTarget, padded_token_count: Any, count: int) -> int:
    if count > target.max_tokens:
        raise ValueError(f"positions: {count} tokens > max_tokens {target.max_tokens} "
                         f"of gpu_view{_shortest_token_field(target)}")
    return check_padded(padded_token_count, "padded_token_count", count,
                        "number of tokens {count}", high=target.max_tokens,
                        high_name="gpu_view max_tokens")
