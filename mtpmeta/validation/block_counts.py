"""The opt-in per-row block counts (contract §5 and §10, "Block counts"): their
validation and the refusals that name them (the kernels' side: ``kernels.counted``).

``block_counts[i]`` says row ``i`` uses the table columns ``[:block_counts[i]]``; the
columns at or past it are never read from the caller, the device rows hold the dummy
block ``D`` there, and a token or draft depth whose block column is at or past the
count is refused before anything is written. Host ints only (a tensor, a numpy array or
a sequence): the counts decide what the host reads and ships, so a device tensor is a
``TypeError`` (reading it back would be a sync). Explicit raises, never ``assert``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mtpmeta.kernels import native
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.validation.inputs import as_host_ints, is_device_tensor

__all__ = ["as_block_counts", "refuse_device_table", "raise_past_count",
           "check_commit_counts", "raise_commit_past_count"]

_first_outside_closed = native.checks.first_outside_closed
_first_bad_commit_count = native.checks.first_bad_commit_count



def as_block_counts(geo: Any, value: Any, rows: int, width: int) -> np.ndarray:
    """``value`` as a C-contiguous int32/int64 array ``[>= rows]`` whose first ``rows``
    entries lie in ``[0, width]``; a ``TypeError`` for a device tensor or a non-integer
    dtype, a ``ValueError`` naming ``block_counts`` and the bound otherwise."""
    counts = _host_counts(geo, value, rows)
    bad = _first_outside_closed(counts[:rows], 0, width)
    if bad >= 0:
        _raise_outside(counts, bad, width)
    return counts


def _host_counts(geo: Any, value: Any, rows: int) -> np.ndarray:
    """``value`` as host ints ``[>= rows]`` (``as_block_counts`` before the range)."""
    if is_device_tensor(value, geo.runtime if geo.mirror else None):
        raise TypeError("block_counts: a device tensor; the counts decide what the host "
                        "reads and ships, so pass them as host ints (a CPU tensor, a "
                        "numpy array or a sequence), e.g. the scheduler's "
                        "request_kv_block_counts on the host")
    counts = as_host_ints(value, "block_counts")
    if counts.shape[0] < rows:
        raise ValueError(f"block_counts: {counts.shape[0]} entries < {rows} rows of the "
                         "block table in use (one count per row)")
    return counts


def _raise_outside(counts: np.ndarray, bad: int, width: int) -> None:
    raise ValueError(f"block_counts: entry {bad} is {int(counts[bad])}, outside "
                     f"[0, {width}] (the block table's width)")


def refuse_device_table(name: str) -> None:
    """``block_counts`` with a device-tensor table (the device route): refused."""
    raise TypeError(f"block_counts: {name} is a device tensor; block counts select the "
                    "columns the host reads and ships, so they need a host table (pass "
                    f"{name} on the host, or omit block_counts)")


def raise_past_count(geo: Any, target: ViewTarget, offsets: np.ndarray,
                     table: np.ndarray, counts: Optional[np.ndarray], row: int) -> bool:
    """Name a draft depth's refusal of row ``row`` when its block column is at or past
    ``counts[row]``; False (nothing raised) when the refusal is another one."""
    if counts is None:
        return False
    column = int(offsets[row]) // geo.block_size_tokens
    if column < int(counts[row]):
        return False
    raise ValueError(f"block_counts: draft row {row} (offset {int(offsets[row])}) writes "
                     f"block column {column}, at or past block_counts[{row}] = "
                     f"{int(counts[row])} (the blocks the row has); allocate the block "
                     "and pass its count before the draft loop that writes it")


def check_commit_counts(geo: Any, counts: np.ndarray, starts: Optional[np.ndarray],
                        value: Any, width: int) -> np.ndarray:
    """A commit pass's ``block_counts`` (``value``) as ``as_block_counts`` returns them
    (its refusals, in its order), refusing too a pass whose token lies at or past its
    request's count: both scans in one kernel."""
    block_counts = _host_counts(geo, value, counts.shape[0])
    code, r = _first_bad_commit_count(counts, starts if starts is not None else counts,
                                      starts is not None, block_counts, width,
                                      geo.block_size_tokens)
    if code == 1:
        _raise_outside(block_counts, r, width)
    if code:
        raise_commit_past_count(geo, counts, starts, block_counts, r)
    return block_counts


def raise_commit_past_count(geo: Any, counts: np.ndarray, starts: Optional[np.ndarray],
                            block_counts: np.ndarray, r: int) -> None:
    start = 0 if starts is None else int(starts[r])
    last = start + int(counts[r]) - 1
    raise ValueError(f"block_counts: request {r} (positions {start}..{last}) writes block "
                     f"column {last // geo.block_size_tokens}, at or past "
                     f"block_counts[{r}] = {int(block_counts[r])} (the blocks the row "
                     "has); allocate the block and pass its count")
