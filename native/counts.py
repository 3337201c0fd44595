"""The table rows of a commit pass with the opt-in block counts (``mtpmeta.validation.block_counts``).

``staging.commit_pass`` writes everything else of the pass (called with a first table
row past the last request, it writes no table row); ``write_counted_rows`` then writes
the rows, reading each request's used columns only. Leaf kernel: it calls no other
file's kernel (numba's on-disk cache does not track other files).
"""

import numpy as np
from numba import njit


@njit(cache=True)
def write_counted_rows(block_table, block_counts, num_prefill, staged, padded, dummy,
                       fill, absorb_end, block_size, known, known_rows, mha_block_table):
    """Rows ``[0, padded)`` of a commit pass's ``mha_block_table`` (``C`` columns: the
    view's ``W``, or a packed shadow of ``C <= W`` on the mirror path): request
    ``r < num_prefill`` takes ``block_table[r, :block_counts[r]]`` (never a column past
    it) and ``fill`` after (``dummy`` for the opt-in counts; -1 for counts derived from
    a table's trailing -1 run, whose absorbing case the caller never sends here); rows
    ``[num_prefill, staged)`` (the pad request) all ``dummy``; rows ``[staged,
    padded)`` all -1. ``absorb_end >= 0``: request ``num_prefill - 1`` absorbs a full
    batch's pad and its columns wholly at or past position ``absorb_end`` get ``dummy``
    too (``staging.dummy_past_span``). ``known`` [>= padded] int32: for rows ``<
    known_rows`` the columns from ``known[i]`` on already hold ``fill`` (a packed slot
    written before at this fill), so only the columns before it are filled;
    ``known[i]`` becomes what the row holds now (its count; for the pad request 0 when
    ``fill`` is ``dummy``, else ``C``; ``C`` for a -1 row). ``known_rows`` 0 fills every
    column.

    >>> table, known = np.zeros((3, 3), np.int32), np.zeros(3, np.int32)
    >>> write_counted_rows(np.array([[3, 4, 5], [6, 7, 8]]), np.array([1, 3]), 2, 2, 3,
    ...                    99, 99, 5, 4, known, 0, table); table.tolist(), known.tolist()
    ([[3, 99, 99], [6, 7, 99], [-1, -1, -1]], [1, 3, 3])
    >>> write_counted_rows(np.array([[3, 4, 5]]), np.array([1]), 1, 2, 3, 99, -1, -1, 4,
    ...                    known, 0, table); table.tolist(), known.tolist()
    ([[3, -1, -1], [99, 99, 99], [-1, -1, -1]], [1, 3, 3])
    """
    _counted_rows(0, padded, block_table, block_counts, num_prefill, staged, dummy, fill,
                  known, known_rows, mha_block_table)
    _absorb(num_prefill, absorb_end, block_size, dummy, mha_block_table)


@njit(cache=True, inline='always')
def _counted_rows(first, end, block_table, block_counts, num_prefill, staged, dummy, fill,
                  known, known_rows, mha_block_table):
    """Rows ``[first, end)`` of ``write_counted_rows`` and their ``known``."""
    width = mha_block_table.shape[1]
    for i in range(first, end):
        stale = np.int64(known[i]) if i < known_rows else np.int64(width)
        if i >= staged:
            for col in range(width):
                mha_block_table[i, col] = -1
            known[i] = width
            continue
        if i >= num_prefill:  # the pad request: all dummy
            for col in range(0, width if fill != dummy else stale):
                mha_block_table[i, col] = dummy
            known[i] = 0 if fill == dummy else width
            continue
        used = min(np.int64(block_counts[i]), width)
        for col in range(used):
            mha_block_table[i, col] = block_table[i, col]
        for col in range(used, stale):
            mha_block_table[i, col] = fill
        known[i] = used


@njit(cache=True, inline='always')
def _absorb(num_prefill, absorb_end, block_size, dummy, mha_block_table):
    """``absorb_end >= 0``: the absorbing request's columns wholly at or past it get
    ``dummy`` (``write_counted_rows``)."""
    if absorb_end >= 0 and num_prefill > 0:
        first = (np.int64(absorb_end) + block_size - 1) // block_size
        for col in range(first, mha_block_table.shape[1]):
            mha_block_table[num_prefill - 1, col] = dummy
