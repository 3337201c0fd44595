"""The scheduler's rows: the declared row split, the annotation offset, repeated rows.

A scheduler keeps its paused requests in rows ``[0, paused)`` of its context and the
active ones in ``[paused, total)``. ``MTPMetadata.set_request_rows(paused, total)``
declares that split for ONE step (``RequestRows``): the step's commit pass, then its
draft loop's ``begin_decode``, which ends it. While it lives, a per-request array of
exactly ``R = max_requests`` rows (entries) is the context's whole array, and a call over
``P`` requests takes its active rows ``[paused, paused + P)``; an array of any other
length is the caller's active slice. Worked example, ``R = 8``, split ``(1, 3)``, a
commit pass of ``P = 2`` requests::

    block_table [8, W]        -> block_table[1:3]     (the context's whole table)
    block_table [2, W]        -> block_table          (already the active slice)
    start_positions [8]       -> start_positions[1:3]
    inherited_blocks None     -> request_matched_prefix_blocks[1:3]

Once a split ended, the fused calls refuse until the next declaration, so a split the
caller forgot to declare again never applies a stale paused count, and an array never
silently changes meaning. An ``R``-row array of the caller's own, holding its ``P``
requests from row 0, is passed as ``array[:P]`` while a split lives. ``P`` larger than
the split's active rows is refused. Every check here raises before anything is written.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Tuple

import numpy as np

__all__ = ["RequestRows", "check_annotation_offset", "refuse_repeated_rows",
           "leading_length", "raise_split_ended", "raise_protected_start"]


def _as_int(value: Any, name: str) -> int:
    """``value`` as an int: a Python int or a numpy integer, never a bool, float or
    string (``TypeError`` naming ``name``)."""
    if type(value) is int:  # the hot path (a bool's type is bool)
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")


def check_annotation_offset(max_requests: int, value: Any,
                            split: Optional["RequestRows"]) -> int:
    """``draft_annotation_offset`` as an int in ``[0, max_requests]``; while a split
    lives (``split``), only its paused count: the two name one row split."""
    offset = _as_int(value, "draft_annotation_offset")
    if not 0 <= offset <= max_requests:
        raise ValueError(f"draft_annotation_offset: {offset} is outside [0, max_requests "
                         f"{max_requests}] (the count of paused rows in front of the "
                         "active ones)")
    if split is not None and offset != split.paused:
        raise ValueError(f"draft_annotation_offset: {offset}, but set_request_rows("
                         f"{split.paused}, {split.total}) declared {split.paused} paused "
                         "rows for this step; declare the step's split instead")
    return offset


def raise_split_ended(method: str) -> NoReturn:
    """The refusal of a fused call after the declared split ended (module docstring)."""
    raise ValueError(f"{method}: the row split set_request_rows declared has served its "
                     "step (one setup_commit_pass, then begin_decode, which ends it; a "
                     "re-allocation ends it too); declare this step's split with "
                     "set_request_rows(paused, total) first")


def raise_protected_start(code: int, row: int, paused: int, starts: Any,
                          annotations: Any, spans: Any, block_size: int) -> NoReturn:
    """Name ``native.checks.first_protected_start``'s refusal of draft row ``row``."""
    start, context_row = int(starts[row]), paused + row
    if code == 1:
        raise ValueError(
            f"start_positions: draft row {row} (context row {context_row}) starts at "
            f"{start}, inside its {int(annotations[context_row])} inherited blocks "
            f"(block column {start // block_size}): a draft would overwrite a shared "
            "prefix block")
    raise ValueError(
        f"start_positions: draft row {row} (context row {context_row}) starts at "
        f"{start}, inside positions {int(spans[0, context_row])}.."
        f"{int(spans[1, context_row]) - 1} the commit pass just before wrote for it: "
        "a draft starts at start + count of the commit pass")


def refuse_repeated_rows(method: str, rows: np.ndarray, num_rows: int, name: str) -> None:
    """Refuse a row that appears twice in ``rows`` (``-1`` and ``num_rows - 1`` are one
    row): a swap through it would move one annotation twice. Rows outside
    ``[-num_rows, num_rows)`` are left to the row kernel's refusal."""
    if rows.shape[0] < 2:
        return
    values = rows.tolist()
    if len(set(values)) == len(values) and min(values) >= 0:
        return  # the usual case (under 1 µs for a few rows): distinct, none negative
    normal = np.where(rows < 0, rows + num_rows, rows)
    if ((normal < 0) | (normal >= num_rows)).any():
        return
    order = np.argsort(normal, kind="stable")
    repeats = np.flatnonzero(normal[order][1:] == normal[order][:-1])
    if repeats.size:
        first, second = sorted(order[repeats[0]:repeats[0] + 2])
        raise ValueError(f"{method}: {name} repeats row {int(normal[first])} (entries "
                         f"{first} and {second}); each row may appear once")


class RequestRows:
    """A declared split: rows ``[0, paused)`` paused, ``[paused, total)`` active, of a
    context of ``max_requests`` rows (module docstring)."""

    __slots__ = ("paused", "total", "max_requests", "committed")

    def __init__(self, max_requests: int, paused_count: Any, total_count: Any) -> None:
        paused = _as_int(paused_count, "paused_count")
        total = _as_int(total_count, "total_count")
        if not 0 <= total <= max_requests:
            raise ValueError(f"total_count: {total} is outside [0, max_requests "
                             f"{max_requests}]")
        if not 0 <= paused <= total:
            raise ValueError(f"paused_count: {paused} is outside [0, total_count {total}]")
        self.paused, self.total, self.max_requests = paused, total, max_requests
        self.committed = False  # whether the step's commit pass has used it

    def __repr__(self) -> str:
        return f"RequestRows(paused={self.paused}, total={self.total})"

    def active(self, count: Any, name: str, *arrays: Any) -> Tuple[Any, ...]:
        """``arrays`` with each whole context array (exactly ``max_requests`` rows) cut
        to its active rows ``[paused, paused + count)``; the others as given. ``count``
        (the call's request count, named ``name``) must fit the active rows; a count
        that is not an int is left to the call's own check."""
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool):
            return arrays
        active = self.total - self.paused
        if count > active:
            raise ValueError(f"{name}: {int(count)} requests, but set_request_rows("
                             f"{self.paused}, {self.total}) declared {active} active rows")
        if not self.paused:
            return arrays
        rows = slice(self.paused, self.paused + int(count))
        whole = self.max_requests
        return tuple(array[rows] if leading_length(array) == whole else array
                     for array in arrays)


def leading_length(value: Any) -> Optional[int]:
    """The leading length of an array argument (tensor, ndarray, sequence), or None
    (a scalar). An array's ``shape[0]``: a tensor's ``len`` goes through Python."""
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return shape[0] if len(shape) else None
    try:
        return len(value)
    except TypeError:
        return None

