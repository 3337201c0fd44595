"""The table rows of a commit pass with the opt-in block counts (``mtpmeta.block_counts``).

``staging.commit_pass`` writes everything else of the pass (called with a first table
row past the last request, it writes no table row); ``write_counted_rows`` then writes
the rows, reading each request's used columns only. Leaf kernel: it calls no other
file's kernel (numba's on-disk cache does not track other files).
"""

import numpy as np
from numba import njit


@njit(cache=True)
def write_counted_rows(block_table, block_counts, num_prefill, staged, padded, dummy,
                       absorb_end, block_size, known, known_rows, mha_block_table):
    """Rows ``[0, padded)`` of a commit pass's ``mha_block_table`` (``C`` columns: the
    view's ``W``, or a packed shadow of ``C <= W`` on the mirror path): request
    ``r < num_prefill`` takes ``block_table[r, :block_counts[r]]`` (never a column past
    it) and ``dummy`` after; rows ``[num_prefill, staged)`` (the pad request) all
    ``dummy``; rows ``[staged, padded)`` all -1. ``absorb_end >= 0``: request
    ``num_prefill - 1`` absorbs a full batch's pad and its columns wholly at or past
    position ``absorb_end`` get ``dummy`` too (``staging.dummy_past_span``).
    ``known`` [>= padded] int32: for rows ``< known_rows`` the columns from ``known[i]``
    on already hold ``dummy`` (a packed slot written before), so only the columns
    before it are filled; ``known[i]`` becomes what the row holds now (its count; 0 for
    the pad request, ``C`` for a -1 row). ``known_rows`` 0 fills every column.

    >>> table, known = np.zeros((3, 3), np.int32), np.zeros(3, np.int32)
    >>> write_counted_rows(np.array([[3, 4, 5], [6, 7, 8]]), np.array([1, 3]), 2, 2, 3,
    ...                    99, 5, 4, known, 0, table); table.tolist(), known.tolist()
    ([[3, 99, 99], [6, 7, 99], [-1, -1, -1]], [1, 3, 3])
    """
    width = mha_block_table.shape[1]
    for i in range(padded):
        stale = np.int64(known[i]) if i < known_rows else np.int64(width)
        if i >= staged:
            for col in range(width):
                mha_block_table[i, col] = -1
            known[i] = width
            continue
        used = np.int64(0)
        if i < num_prefill:
            used = min(np.int64(block_counts[i]), width)
            for col in range(used):
                mha_block_table[i, col] = block_table[i, col]
        for col in range(used, stale):
            mha_block_table[i, col] = dummy
        known[i] = used
    if absorb_end >= 0 and num_prefill > 0:
        first = (np.int64(absorb_end) + block_size - 1) // block_size
        for col in range(first, width):
            mha_block_table[num_prefill - 1, col] = dummy


@njit(cache=True)
def stage_ragged_rows(block_table, block_counts, num_prefill, dummy, absorb_end,
                      block_size, width, index, values):
    """The used entries of a commit pass's table rows, ragged (the mirror path's
    counted commit): ``k`` entries, row-major, request ``r < num_prefill`` giving
    ``block_table[r, :block_counts[r]]`` (never a column past it; with ``absorb_end
    >= 0`` request ``num_prefill - 1`` stops before its first column wholly at or past
    position ``absorb_end``, as ``write_counted_rows``). Entry ``j`` goes to
    ``values[k + j]`` (``values`` viewing the same bytes as ``index``, so the entries
    sit right after the ``k`` int64 words of ``index``: ``values`` starts at index word
    ``k``, i.e. at element ``k * 8 // itemsize``) and its flat destination
    ``r * width + column`` to ``index[j]``. Every other entry of rows
    ``[:staged]`` is ``dummy``, written by the device. Returns ``k``, or -1 (nothing
    written) when ``k`` int64 words and ``k`` values do not fit ``index``'s bytes.
    index: int64 [cap]; values: the view's table dtype, the same memory.

    >>> region = np.zeros(8, np.int64)
    >>> values = region.view(np.int32)
    >>> stage_ragged_rows(np.array([[3, 4, 5], [6, 7, 8]]), np.array([1, 2]), 2, 99,
    ...                   -1, 4, 3, region, values)
    3
    >>> region[:3].tolist(), values[6:9].tolist()
    ([0, 3, 4], [3, 6, 7])
    """
    item = values.itemsize
    cut = np.int64(-1)  # the absorbing request's used columns end here
    if absorb_end >= 0 and num_prefill > 0:
        cut = (np.int64(absorb_end) + block_size - 1) // block_size
    total = np.int64(0)
    for r in range(num_prefill):
        used = np.int64(block_counts[r])
        if r == num_prefill - 1 and 0 <= cut < used:
            used = cut
        total += used
    if total * (8 + item) > index.shape[0] * 8:
        return -1
    base = total * 8 // item
    k = np.int64(0)
    for r in range(num_prefill):
        used = np.int64(block_counts[r])
        if r == num_prefill - 1 and 0 <= cut < used:
            used = cut
        row = np.int64(r) * width
        for col in range(used):
            index[k] = row + col
            values[base + k] = block_table[r, col]
            k += 1
    return total
