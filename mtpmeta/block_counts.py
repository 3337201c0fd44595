"""The opt-in per-row block counts (contract §5 and §10, "Block counts"): validation,
the refusals that name them, and the column bucket the mirror path ships.

``block_counts[i]`` says row ``i`` uses the table columns ``[:block_counts[i]]``; the
columns at or past it are never read from the caller, the device rows hold the dummy
block ``D`` there, and a token or draft depth whose block column is at or past the
count is refused before anything is written. Host ints only (a tensor, a numpy array or
a sequence): the counts decide what the host reads and ships, so a device tensor is a
``TypeError`` (reading it back would be a sync). Explicit raises, never ``assert``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import native, table_threads
from .gpu_view import ViewTarget
from .inputs import as_host_ints, is_device_tensor, kernel_optional

__all__ = ["as_block_counts", "refuse_device_table", "column_bucket",
           "raise_past_count", "check_commit_counts", "raise_commit_past_count",
           "counted_commit", "MIN_BUCKET"]

_first_outside_closed = native.checks.first_outside_closed
_first_past_count = native.checks.first_past_count
MIN_BUCKET = 8  # the narrowest shipped width: buckets are MIN_BUCKET * 2**k, capped at W


def as_block_counts(geo: Any, value: Any, rows: int, width: int) -> np.ndarray:
    """``value`` as a C-contiguous int32/int64 array ``[>= rows]`` whose first ``rows``
    entries lie in ``[0, width]``; a ``TypeError`` for a device tensor or a non-integer
    dtype, a ``ValueError`` naming ``block_counts`` and the bound otherwise."""
    if is_device_tensor(value, geo.runtime if geo.mirror else None):
        raise TypeError("block_counts: a device tensor; the counts decide what the host "
                        "reads and ships, so pass them as host ints (a CPU tensor, a "
                        "numpy array or a sequence), e.g. the scheduler's "
                        "request_kv_block_counts on the host")
    counts = as_host_ints(value, "block_counts")
    if counts.shape[0] < rows:
        raise ValueError(f"block_counts: {counts.shape[0]} entries < {rows} rows of the "
                         "block table in use (one count per row)")
    bad = _first_outside_closed(counts[:rows], 0, width)
    if bad >= 0:
        raise ValueError(f"block_counts: entry {bad} is {int(counts[bad])}, outside "
                         f"[0, {width}] (the block table's width)")
    return counts


def refuse_device_table(name: str) -> None:
    """``block_counts`` with a device-tensor table (the device route): refused."""
    raise TypeError(f"block_counts: {name} is a device tensor; block counts select the "
                    "columns the host reads and ships, so they need a host table (pass "
                    f"{name} on the host, or omit block_counts)")


def column_bucket(max_count: int, width: int) -> int:
    """The shipped width ``C`` for rows whose largest count is ``max_count``: the
    smallest ``MIN_BUCKET * 2**k >= max_count``, capped at ``width``. At most
    ``ceil(log2(width / MIN_BUCKET)) + 1`` distinct values (one if ``width <=
    MIN_BUCKET``), so no per-shape state grows."""
    columns = MIN_BUCKET
    while columns < max_count:
        columns *= 2
    return columns if columns < width else width


def first_row_past_packed(offsets: np.ndarray, count: int, block_size: int,
                          columns: int, row: int) -> int:
    """The draft row a whole-row depth refuses first when the host truth is packed
    ``[n, C]`` rows (``C = columns``): the earlier of ``row`` (-1: none) and the first
    row ``i < count`` whose column ``offsets[i] // block_size`` lies at or past ``C``
    (past its count; -1 there for derived counts), which the packed rows cannot
    hold. offsets: int32 [>= count]."""
    past = np.flatnonzero(offsets[:count] // block_size >= columns)
    if past.size and (row < 0 or int(past[0]) < row):
        return int(past[0])
    return row


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
                        block_counts: np.ndarray) -> None:
    """Refuse a commit pass whose token lies at or past its request's block count."""
    r = _first_past_count(counts, starts if starts is not None else counts,
                          starts is not None, block_counts, geo.block_size_tokens)
    if r >= 0:
        raise_commit_past_count(geo, counts, starts, block_counts, r)


def raise_commit_past_count(geo: Any, counts: np.ndarray, starts: Optional[np.ndarray],
                            block_counts: np.ndarray, r: int) -> None:
    start = 0 if starts is None else int(starts[r])
    last = start + int(counts[r]) - 1
    raise ValueError(f"block_counts: request {r} (positions {start}..{last}) writes block "
                     f"column {last // geo.block_size_tokens}, at or past "
                     f"block_counts[{r}] = {int(block_counts[r])} (the blocks the row "
                     "has); allocate the block and pass its count")


_NO_TABLE_ROW = 2**31 - 1  # commit_pass's first table row: past every request


def counted_commit(counts: np.ndarray, starts: Optional[np.ndarray], table: np.ndarray,
                   inherited: Optional[np.ndarray], block_counts: np.ndarray,
                   padded_tokens: int, pad_tokens: int, max_requests: int,
                   min_padded_requests: int, block_size: int, dummy: int, width: int,
                   high: int, lengths: np.ndarray, token_args: tuple, request_args: tuple,
                   known: np.ndarray, known_rows: int, fill: Optional[int] = None
                   ) -> Tuple[int, int, int, int]:
    """A commit pass with counts, both paths: ``native.staging.commit_pass`` for all but
    the table rows (its refusals included: then nothing is written), then
    ``native.counts.write_counted_rows`` into ``request_args[4]`` (the view's
    ``mha_block_table`` or a packed shadow; ``known``, ``known_rows`` as there, and
    ``known`` at least as long as the pass's padded requests; ``fill``, the rows' value
    past their counts, ``dummy`` by default). Returns as the kernel."""
    table_rows = request_args[4]
    result = native.staging.commit_pass(
        counts, *kernel_optional(starts), table, *kernel_optional(inherited),
        padded_tokens, pad_tokens, max_requests, min_padded_requests, block_size, dummy,
        _NO_TABLE_ROW, width, high, lengths, *token_args, *request_args[:4],
        table_rows[:0])
    if result[0] < 0:
        return result
    num_prefill = counts.shape[0]
    absorb = -1  # a full batch's last request absorbs the pad: its span's end
    if pad_tokens > 0 and result[1] == num_prefill and num_prefill:
        start = 0 if starts is None else int(starts[num_prefill - 1])
        absorb = start + int(counts[num_prefill - 1])
    table_threads.write_counted_rows(table, block_counts, num_prefill, result[1],
                                     result[2], dummy, dummy if fill is None else fill,
                                     absorb, block_size, known, known_rows, table_rows)
    return result
