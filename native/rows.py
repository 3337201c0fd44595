"""Request-row annotation kernels.

``values`` is the host annotation array (``request_matched_prefix_blocks``), int32
``[max_requests]``. Row index arrays are int32 or int64 ``[K]`` and may be negative:
``-max_requests <= row < max_requests`` wraps like torch/numpy indexing (the wrapper has
checked the bound).
"""

from numba import njit


@njit(cache=True)
def reset_rows(values, rows):
    """``values[rows] = 0``. values: int32 [R]; rows: int [K]."""
    num_rows = values.shape[0]
    for i in range(rows.shape[0]):
        row = rows[i]
        if row < 0:
            row += num_rows
        values[row] = 0


@njit(cache=True)
def move_rows(values, src, dst, scratch):
    """``values[dst] = values[src]``, every source read before any destination is written.

    values: int32 [R]; src, dst: int [K]; scratch: int32 [>= K].
    Example: values [5, 6, 7], src [0, 1], dst [1, 2] -> [5, 5, 6] (overlap is safe).
    """
    num_rows = values.shape[0]
    count = src.shape[0]
    for i in range(count):
        row = src[i]
        if row < 0:
            row += num_rows
        scratch[i] = values[row]
    for i in range(count):
        row = dst[i]
        if row < 0:
            row += num_rows
        values[row] = scratch[i]


@njit(cache=True)
def swap_rows(values, src, dst, scratch):
    """Swap ``values[src]`` and ``values[dst]`` the way the contract orders it.

    Both sides are read first; then ``values[dst] = old[src]``; then
    ``values[src] = old[dst]`` (an index on both sides ends with the second assignment).
    values: int32 [R]; src, dst: int [K]; scratch: int32 [>= 2K].
    Example: values [5, 6, 7], src [0, 1], dst [1, 2] -> [6, 7, 6].
    """
    num_rows = values.shape[0]
    count = src.shape[0]
    for i in range(count):
        src_row = src[i]
        if src_row < 0:
            src_row += num_rows
        dst_row = dst[i]
        if dst_row < 0:
            dst_row += num_rows
        scratch[i] = values[src_row]
        scratch[count + i] = values[dst_row]
    for i in range(count):
        row = dst[i]
        if row < 0:
            row += num_rows
        values[row] = scratch[i]
    for i in range(count):
        row = src[i]
        if row < 0:
            row += num_rows
        values[row] = scratch[count + i]
