"""Request-row annotation kernels.

``values`` is the host annotation array (``request_matched_prefix_blocks``), int32
``[max_requests]``. Row index arrays are int32 or int64 ``[K]`` and may be negative:
``-max_requests <= row < max_requests`` wraps like torch/numpy indexing. Each kernel
checks that bound for every index BEFORE it writes, and returns the position of the
first index outside it (-1 when all are inside), so a bad index changes nothing.
"""

from numba import njit


@njit(cache=True, inline='always')
def _wrap(row, num_rows):
    """``row`` in ``[-num_rows, num_rows)`` as a row in ``[0, num_rows)``, like numpy."""
    if row < 0:
        return row + num_rows
    return row


@njit(cache=True)
def first_row_outside(rows, num_rows):
    """First ``i`` with ``rows[i]`` outside ``[-num_rows, num_rows)``, else -1.

    >>> first_row_outside(np.array([0, -3, 3]), 3), first_row_outside(np.array([2]), 3)
    (2, -1)
    """
    for i in range(rows.shape[0]):
        if rows[i] < -num_rows or rows[i] >= num_rows:
            return i
    return -1


@njit(cache=True)
def reset_rows(values, rows):
    """``values[rows] = 0``; returns -1, or the first bad ``i`` (nothing written).

    values: int32 [R]; rows: int [K].

    >>> values = np.array([5, 6, 7], dtype=np.int32)
    >>> reset_rows(values, np.array([-1, 0])), values.tolist()
    (-1, [0, 6, 0])
    >>> reset_rows(values, np.array([1, 3])), values.tolist()  # rows[1] = 3 is refused
    (1, [0, 6, 0])
    """
    num_rows = values.shape[0]
    bad = first_row_outside(rows, num_rows)
    if bad >= 0:
        return bad
    for i in range(rows.shape[0]):
        values[_wrap(rows[i], num_rows)] = 0
    return -1


@njit(cache=True)
def first_pair_outside(src, dst, num_rows):
    """-1 when every index of ``src`` and ``dst`` [K] is a valid row; else the first
    bad one: ``i`` for ``src[i]``, ``K + i`` for ``dst[i]``.

    >>> first_pair_outside(np.array([0, 1]), np.array([2, -4]), 3)  # dst[1]: K + 1
    3
    """
    bad = first_row_outside(src, num_rows)
    if bad >= 0:
        return bad
    bad = first_row_outside(dst, num_rows)
    if bad >= 0:
        return src.shape[0] + bad
    return -1


@njit(cache=True)
def move_rows(values, src, dst, scratch):
    """``values[dst] = values[src]``, every source read before any destination is written.
    Returns ``first_pair_outside`` (-1 when done; otherwise nothing was written).

    values: int32 [R]; src, dst: int [K]; scratch: int32 [>= K].
    Example: values [5, 6, 7], src [0, 1], dst [1, 2] -> [5, 5, 6] (overlap is safe).

    >>> values, scratch = np.array([5, 6, 7], dtype=np.int32), np.empty(4, np.int32)
    >>> move_rows(values, np.array([0, 1]), np.array([1, 2]), scratch), values.tolist()
    (-1, [5, 5, 6])
    >>> move_rows(values, np.array([0, 1]), np.array([1, 3]), scratch), values.tolist()
    (3, [5, 5, 6])
    """
    num_rows = values.shape[0]
    count = src.shape[0]
    bad = first_pair_outside(src, dst, num_rows)
    if bad >= 0:
        return bad
    for i in range(count):
        scratch[i] = values[_wrap(src[i], num_rows)]
    for i in range(count):
        values[_wrap(dst[i], num_rows)] = scratch[i]
    return -1


@njit(cache=True)
def swap_rows(values, src, dst, scratch):
    """Swap ``values[src]`` and ``values[dst]`` the way the contract orders it.

    Both sides are read first; then ``values[dst] = old[src]``; then
    ``values[src] = old[dst]`` (an index on both sides ends with the second assignment).
    Returns ``first_pair_outside`` (-1 when done; otherwise nothing was written).
    values: int32 [R]; src, dst: int [K]; scratch: int32 [>= 2K].
    Example: values [5, 6, 7], src [0, 1], dst [1, 2] -> [6, 7, 6].

    >>> values, scratch = np.array([5, 6, 7], dtype=np.int32), np.empty(4, np.int32)
    >>> swap_rows(values, np.array([0, 1]), np.array([1, 2]), scratch), values.tolist()
    (-1, [6, 7, 6])
    """
    num_rows = values.shape[0]
    count = src.shape[0]
    bad = first_pair_outside(src, dst, num_rows)
    if bad >= 0:
        return bad
    for i in range(count):
        scratch[i] = values[_wrap(src[i], num_rows)]
        scratch[count + i] = values[_wrap(dst[i], num_rows)]
    for i in range(count):
        values[_wrap(dst[i], num_rows)] = scratch[i]
    for i in range(count):
        values[_wrap(src[i], num_rows)] = scratch[count + i]
    return -1
