"""The draft loop's host state: the begin's checked copy of start positions and table
rows, the capture fill, the advances, and how many leading rows of a commit pass's
table equal that state (the rows a commit may take from the device).

Shapes: ``R`` max requests, ``W`` block-table width; offsets ``[R]`` int32, tables
``[R, W]`` (``[>= n, W]`` for a caller's). Leaf kernels: none calls another file's
kernel (numba's on-disk cache does not track other files). ``staging`` holds the
kernels that write token maps and MHA metadata.
"""

import numpy as np
from numba import njit


@njit(cache=True)
def offsets_in_table(offsets, count, block_size, width):
    """True when every ``offsets[:count]`` is >= 0 and its block column ``< width``.

    >>> offsets = np.array([0, 15, 16])  # block size 8: columns 0, 1, 2
    >>> offsets_in_table(offsets, 2, 8, 2), offsets_in_table(offsets, 3, 8, 2)
    (True, False)
    """
    # A power-of-two block size takes a shift, which floors as // does (staging's
    # _shift_of, kept here: numba's on-disk cache does not track other files).
    shift = 0
    while shift < 62 and (np.int64(1) << shift) < block_size:
        shift += 1
    if (np.int64(1) << shift) != block_size:
        shift = -1
    for t in range(count):
        position = np.int64(offsets[t])
        column = position >> shift if shift >= 0 else position // block_size
        if position < 0 or column >= width:
            return False
    return True


@njit(cache=True)
def copy_decode_inputs(start_positions, table_src, count, block_size, offsets,
                       block_table):
    """``offsets[:count] = start_positions[:count]``; ``block_table[:count] = table_src[:count]``.

    Returns False and writes nothing when a start position is negative or its block
    column is ``>= W`` (``offsets_in_table``); True after the copy.
    start_positions: int [>= count]; table_src: int [>= count, W];
    offsets: int32 [R]; block_table: int32/int64 [R, W].

    >>> offsets, table = np.zeros(3, np.int32), np.zeros((3, 2), np.int32)
    >>> src = np.array([[3, 4], [6, 7]])
    >>> copy_decode_inputs(np.array([5, 9]), src, 2, 8, offsets, table)
    True
    >>> offsets.tolist(), table.tolist()
    ([5, 9, 0], [[3, 4], [6, 7], [0, 0]])
    >>> copy_decode_inputs(np.array([5, 16]), src, 2, 8, offsets, table)  # column 2 >= W
    False
    """
    width = block_table.shape[1]
    if not offsets_in_table(start_positions, count, block_size, width):
        return False
    for i in range(count):
        offsets[i] = start_positions[i]
        for col in range(width):
            block_table[i, col] = table_src[i, col]
    return True


@njit(cache=True)
def fill_capture_state(offsets, block_table, count, dummy):
    """Scratch-only draft state: ``offsets[:count] = 0``, ``block_table[:count] = dummy``.

    >>> offsets, table = np.array([5, 9, 4], np.int32), np.ones((3, 2), np.int32)
    >>> fill_capture_state(offsets, table, 2, 99); offsets.tolist(), table.tolist()
    ([0, 0, 4], [[99, 99], [99, 99], [1, 1]])
    """
    width = block_table.shape[1]
    for i in range(count):
        offsets[i] = 0
        for col in range(width):
            block_table[i, col] = dummy


@njit(cache=True)
def advance_offsets(offsets, count):
    """``offsets[:count] += 1``. offsets: int32 [R].

    >>> offsets = np.array([5, 9, 4], np.int32)
    >>> advance_offsets(offsets, 2); offsets.tolist()
    [6, 10, 4]
    """
    for i in range(count):
        offsets[i] += 1


@njit(cache=True)
def matching_rows(block_table, truth, count):
    """The longest ``k <= count`` such that ``block_table[i, c] == truth[i, c]`` (as
    integers) for every row ``i < k`` and column ``c < W = truth.shape[1]``: how many
    leading rows of a commit pass's table the persistent device table, whose host copy
    is ``truth``, already holds. The scan stops at the end of the first row that
    differs (a row is scanned branch-free), so with the commit kernel copying rows
    ``[k:]`` each row is compared or copied, and only row ``k`` both.
    block_table: int [>= count, >= W]; truth: int [>= count, W].

    >>> truth = np.array([[3, 4], [5, 6], [7, 8]], np.int32)
    >>> matching_rows(np.array([[3, 4], [5, 7], [7, 8]]), truth, 3)
    1
    >>> matching_rows(truth, truth, 3), matching_rows(truth + 1, truth, 3)
    (3, 0)
    """
    width = truth.shape[1]
    for i in range(count):
        differs = np.int64(0)
        for col in range(width):
            differs |= np.int64(block_table[i, col]) ^ np.int64(truth[i, col])
        if differs != 0:
            return i
    return count


@njit(cache=True)
def copy_counted_inputs(start_positions, table_src, block_counts, count, block_size,
                        dummy, offsets, block_table, counts_out):
    """``copy_decode_inputs`` with the opt-in block counts: row ``i`` of
    ``block_table`` takes ``table_src[i, :block_counts[i]]`` and ``dummy`` at and past
    the count (``table_src`` is never read there); ``counts_out[:count]`` takes the
    counts. Returns False and writes nothing on a bad start (``offsets_in_table``).
    block_counts: int [>= count], each in ``[0, W]`` (checked by the caller).

    >>> offsets, table, used = np.zeros(2, np.int32), np.zeros((2, 3), np.int32), \\
    ...     np.zeros(2, np.int32)
    >>> src = np.array([[3, 4, 5], [6, 7, 8]])
    >>> copy_counted_inputs(np.array([1, 9]), src, np.array([1, 2]), 2, 8, 99, offsets,
    ...                     table, used)
    True
    >>> table.tolist(), used.tolist()
    ([[3, 99, 99], [6, 7, 99]], [1, 2])
    """
    width = block_table.shape[1]
    if not offsets_in_table(start_positions, count, block_size, width):
        return False
    for i in range(count):
        offsets[i] = start_positions[i]
        used = np.int64(block_counts[i])
        counts_out[i] = used
        for col in range(used):
            block_table[i, col] = table_src[i, col]
        for col in range(used, width):
            block_table[i, col] = dummy
    return True


@njit(cache=True)
def stage_counted_inputs(start_positions, table_src, block_counts, count, block_size,
                         dummy, width, offsets, packed, packed_widths, packed_rows,
                         counts_out):
    """The mirror path's begin with block counts, one pass over the used columns:
    ``offsets``/``counts_out`` as ``copy_counted_inputs``; ``packed`` [>= count, C]
    (the pinned slot, ``C`` columns per row, the host truth of the draft loop) takes
    row ``i``'s used entries and ``dummy`` up to ``C``, written only where it may be
    missing: over ``[block_counts[i], packed_widths[i])`` for the rows ``<
    packed_rows`` whose packed row is known, else up to ``C``; the width then becomes
    the count. So a step costs O(used + changed) columns, not O(C) per row. Returns
    False and writes nothing on a bad start (``offsets_in_table`` with ``width``, the
    table's ``W``). block_counts: int [>= count], each in ``[0, C]``.

    >>> offsets, used, known = np.zeros(2, np.int32), np.zeros(2, np.int32), \\
    ...     np.zeros(2, np.int32)
    >>> packed = np.zeros((2, 2), np.int64)
    >>> stage_counted_inputs(np.array([1, 9]), np.array([[3, 4, 5], [6, 7, 8]]),
    ...                      np.array([1, 2]), 2, 8, 99, 3, offsets, packed, known, 0,
    ...                      used)
    True
    >>> packed.tolist(), known.tolist(), offsets.tolist()
    ([[3, 99], [6, 7]], [1, 2], [1, 9])
    """
    if not offsets_in_table(start_positions, count, block_size, width):
        return False
    _stage_counted_rows(0, count, start_positions, table_src, block_counts, dummy,
                        offsets, packed, packed_widths, packed_rows, counts_out)
    return True


@njit(cache=True, inline='always')
def _stage_counted_rows(first, end, start_positions, table_src, block_counts, dummy,
                        offsets, packed, packed_widths, packed_rows, counts_out):
    """Rows ``[first, end)`` of ``stage_counted_inputs`` (offsets, counts, packed rows)."""
    columns = packed.shape[1]
    for i in range(first, end):
        offsets[i] = start_positions[i]
        used = np.int64(block_counts[i])
        counts_out[i] = used
        for col in range(used):
            packed[i, col] = table_src[i, col]
        stale = np.int64(packed_widths[i]) if i < packed_rows else np.int64(columns)
        for col in range(used, stale):
            packed[i, col] = dummy
        packed_widths[i] = used


@njit(cache=True)
def used_columns(table_src, count, counts_out):
    """Each row's columns before its trailing run of -1: ``counts_out[i] = 1 +`` the last
    column ``c`` with ``table_src[i, c] != -1`` (0 for a row of -1 only), so row ``i``
    holds -1 at and past ``counts_out[i]``. Returns the largest, 0 for no rows. One
    branch-free read of the rows (it vectorizes). table_src: int [>= count, W];
    counts_out: int32 [>= count].

    >>> used = np.zeros(3, np.int32)
    >>> used_columns(np.array([[3, -1, -1], [-1, -1, -1], [4, -1, 5]]), 3, used)
    3
    >>> used.tolist()
    [1, 0, 3]
    """
    largest = np.int64(0)
    for i in range(count):
        used = _row_used(table_src, i)
        counts_out[i] = used
        if used > largest:
            largest = used
    return largest


@njit(cache=True, inline='always')
def _row_used(table_src, i):
    """Row ``i``'s columns before its trailing run of -1 (``used_columns``)."""
    used = np.int64(0)
    for col in range(table_src.shape[1]):
        if table_src[i, col] != -1:
            used = col + 1
    return used
