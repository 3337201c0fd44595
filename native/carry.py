"""Chunk-boundary carry state and its checks.

The carry state is an int64 ``[3]`` array: ``[valid (0/1), req_id, position]``; an
invalid carry holds ``[0, -1, -1]``.
"""

from numba import njit

# Result codes of ``check_take``; the wrapper turns each into its message.
CARRY_OK = 0
CARRY_NOT_VALID = 1
CARRY_OTHER_REQUEST = 2
CARRY_OTHER_POSITION = 3


@njit(cache=True)
def invalidate(state):
    """state: int64 [3] -> ``[0, -1, -1]``."""
    state[0] = 0
    state[1] = -1
    state[2] = -1


@njit(cache=True)
def record(state, req_id, position):
    """state: int64 [3] -> ``[1, req_id, position]``."""
    state[0] = 1
    state[1] = req_id
    state[2] = position


@njit(cache=True)
def check_take(state, req_id, seam_position):
    """Return which take condition fails first (0 when all hold). state: int64 [3].

    1: no valid carry; 2: the carry belongs to another request; 3: it sits at another
    position than ``seam_position``.

    >>> state = np.zeros(3, dtype=np.int64)
    >>> record(state, 7, 42); state.tolist()
    [1, 7, 42]
    >>> check_take(state, 7, 42), check_take(state, 8, 42), check_take(state, 7, 41)
    (0, 2, 3)
    >>> invalidate(state); state.tolist(), check_take(state, 7, 42)
    ([0, -1, -1], 1)
    """
    if state[0] == 0:
        return 1
    if state[1] != req_id:
        return 2
    if state[2] != seam_position:
        return 3
    return 0
