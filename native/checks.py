"""Bound scans for the validating wrappers: each returns the index of the first
offending element, or -1 when every element is in bounds."""

import numpy as np
from numba import njit


@njit(cache=True)
def first_outside(values, low, high):
    """First ``i`` with ``not (low <= values[i] < high)``, else -1. values: int [K].

    >>> first_outside(np.array([0, 5, -1, 9]), 0, 8), first_outside(np.array([7]), 0, 8)
    (2, -1)
    """
    for i in range(values.shape[0]):
        value = values[i]
        if value < low or value >= high:
            return i
    return -1


@njit(cache=True)
def min_max(values, count):
    """``(min, max)`` of ``values[:count]`` as int64; ``(0, -1)`` when count is 0.

    >>> min_max(np.array([4, -2, 9, 1]), 3), min_max(np.array([4]), 0)
    ((-2, 9), (0, -1))
    """
    if count == 0:
        return 0, -1
    low = values[0]
    high = values[0]
    for i in range(1, count):
        value = values[i]
        if value < low:
            low = value
        if value > high:
            high = value
    return low, high


@njit(cache=True)
def first_outside_closed(values, low, high):
    """First ``i`` with ``not (low <= values[i] <= high)``, else -1: ``first_outside``
    with an inclusive upper bound, so ``high`` may be a dtype's maximum. values: int [K].

    >>> first_outside_closed(np.array([0, 127, 128]), -128, 127)
    2
    """
    for i in range(values.shape[0]):
        value = values[i]
        if value < low or value > high:
            return i
    return -1


# Codes of ``first_bad_token_block`` and ``staging.first_bad_commit_block`` (the two
# block scans the staging kernels run first live in ``staging``: numba's on-disk cache
# does not track other files).
from .staging import (BAD_WRITTEN_BLOCK, BLOCKS_OK, INHERITED_OUT_OF_RANGE,  # noqa: E402,F401
                      first_bad_commit_block, first_bad_draft_block)


@njit(cache=True)
def first_bad_token_block(rows, positions, block_table, inherited, has_inherited,
                          block_size, width, high):
    """Scan ``write_token_maps``' tokens; return ``(code, t)``, ``(BLOCKS_OK, -1)``
    when all are good. INHERITED_OUT_OF_RANGE: token ``t``'s row has an inherited
    count outside ``[0, width]``. BAD_WRITTEN_BLOCK: the block token ``t`` writes,
    ``block_table[rows[t], positions[t] // BS]`` (a token not redirected to the dummy
    block by ``inherited``), is negative (an unallocated block) or above ``high`` (does
    not fit the destination). Rows and columns must already be in range
    (``check_token_inputs``). rows, positions: int [T]; block_table: int [B, W];
    inherited: int [> max(rows)].

    >>> table = np.array([[3, -1], [5, 300]])  # block size 8, width 2
    >>> first_bad_token_block(np.array([0, 1, 0]), np.array([7, 9, 8]), table,
    ...                       np.zeros(1, np.int64), False, 8, 2, 127)  # 300 > 127
    (2, 1)
    >>> first_bad_token_block(np.array([0, 0]), np.array([7, 8]), table,
    ...                       np.array([2, 0]), True, 8, 2, 127)  # -1 is redirected
    (0, -1)
    >>> first_bad_token_block(np.array([1]), np.array([0]), table, np.array([0, 3]),
    ...                       True, 8, 2, 127)  # row 1 inherits 3 > width 2
    (1, 0)
    """
    for t in range(positions.shape[0]):
        row = rows[t]
        column = np.int64(positions[t]) // block_size
        if has_inherited:
            protected = inherited[row]
            if protected < 0 or protected > width:
                return INHERITED_OUT_OF_RANGE, t
            if column < protected:
                continue
        block = block_table[row, column]
        if block < 0 or block > high:
            return BAD_WRITTEN_BLOCK, t
    return BLOCKS_OK, -1
