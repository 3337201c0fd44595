"""Bound scans for the validating wrappers: each returns the index of the first
offending element, or -1 when every element is in bounds."""

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
