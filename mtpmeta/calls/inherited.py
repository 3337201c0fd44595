"""``InheritedCopies``: the copy of a forward's inherited-block counts that
``check_invariants`` reads, taken at the call without allocating.

The caller may change its array (the annotations: a row move, a new prefix hit) before
the check runs, so ``ForwardRecord.inherited`` must be a copy taken at the call. Only
the last forward's record reads it, so one ``[R]`` scratch per dtype serves every
forward of an allocation.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

__all__ = ["InheritedCopies"]

_INT32 = np.dtype(np.int32)


class InheritedCopies:
    """Copies of inherited counts into two preallocated ``[R]`` scratches.

    Holds ``scratch64`` (``[R]`` int64) and ``scratch32`` (``[R]`` int32) and their
    prefixes by length: key ``n`` for ``scratch32[:n]``, ``-1 - n`` for
    ``scratch64[:n]``. Invariant: a returned copy stays valid until the next ``copy``
    of the same length and dtype, which is after the record that holds it is replaced.
    """

    __slots__ = ("_max_requests", "_scratch64", "_scratch32", "_views")

    def __init__(self, max_requests: int) -> None:
        self._max_requests = max_requests
        self._scratch64 = np.zeros(max_requests, dtype=np.int64)  # [R] int64 counts
        self._scratch32 = np.zeros(max_requests, dtype=np.int32)  # [R] int32 counts
        self._views: Dict[int, np.ndarray] = {}

    def copy(self, inherited: Any) -> Any:
        """``inherited`` copied now, or None for None. Host arrays of at most ``R``
        entries go into the scratch of their dtype (int32, else int64: a copy without a
        cast is cheaper); longer ones and device tensors are copied anew.

        Example: R 4, ``[2, 1]`` int32 -> ``scratch32[:2]`` holding ``[2, 1]``."""
        if inherited is None:
            return None
        if isinstance(inherited, np.ndarray):
            size = inherited.shape[0]
            key = size if inherited.dtype is _INT32 else -1 - size
            copy = self._views.get(key)
            if copy is None:
                if size > self._max_requests:
                    return inherited.copy()
                scratch = self._scratch64 if key < 0 else self._scratch32
                copy = self._views[key] = scratch[:size]
            copy[...] = inherited
            return copy
        return inherited.clone()
