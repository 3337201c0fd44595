"""The block-count kernels' host side (contract §10, "Block counts"): the column bucket
the mirror path ships, the draft row a packed depth refuses first, and a commit pass with
counts on both paths. Validation of the counts is ``validation.block_counts``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from mtpmeta.kernels import native
from mtpmeta.kernels.entry import kernel_optional

__all__ = ["column_bucket", "first_row_past_packed", "counted_commit", "MIN_BUCKET"]

MIN_BUCKET = 8  # the narrowest shipped width: buckets are MIN_BUCKET * 2**k, capped at W


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
    native.counts.write_counted_rows(table, block_counts, num_prefill, result[1],
                                     result[2], dummy, dummy if fill is None else fill,
                                     absorb, block_size, known, known_rows, table_rows)
    return result
