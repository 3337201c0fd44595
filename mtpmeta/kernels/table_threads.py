"""The opt-in threads of the mirror path's table passes: the derived route's scan
(``used_columns``) and the packed-row copies of a begin and a commit pass with counts
(``stage_counted_inputs``, ``write_counted_rows``), derived or the caller's.

``THREADS`` 1 (the default) runs each on the calling thread. Above 1 (environment
``MTPMETA_TABLE_THREADS`` at import, or this attribute, read at each call) each pass
splits its rows over that many of numba's threads (the ``*_threaded`` kernels:
``parallel=True``, the same writes and results): each call sets numba's thread count
on the calling thread (``numba.set_num_threads``), and the passes take numba's
threading layer (OpenMP or TBB where present, else its workqueue, which must not be
entered from two threads at once). It pays where the table passes are a step's host
cost: wide tables, hundreds of rows (BENCHMARKS.md, the production trace).
"""

from __future__ import annotations

import os

import numba
import numpy as np

from mtpmeta.kernels.loader import native

__all__ = ["THREADS", "threads_from", "used_columns", "stage_counted_inputs",
           "write_counted_rows"]


def threads_from(value: str) -> int:
    """``MTPMETA_TABLE_THREADS``'s value as a thread count in ``[1,
    numba.config.NUMBA_NUM_THREADS]`` ('' is 1); ValueError naming it otherwise."""
    bound = numba.config.NUMBA_NUM_THREADS
    try:
        threads = int(value or 1)
    except ValueError:
        threads = 0
    if not 1 <= threads <= bound:
        raise ValueError(f"MTPMETA_TABLE_THREADS must be an integer in [1, {bound}] "
                         f"(numba.config.NUMBA_NUM_THREADS), got {value!r}")
    return threads


#: Threads of the table passes (module docstring), at most NUMBA_NUM_THREADS.
THREADS = threads_from(os.environ.get("MTPMETA_TABLE_THREADS", ""))


def _threaded() -> bool:
    """Whether the passes run threaded now (and numba's count is set for them)."""
    if THREADS <= 1:
        return False
    numba.set_num_threads(THREADS)
    return True


def used_columns(table: np.ndarray, count: int, counts_out: np.ndarray) -> int:
    """``native.draft_state.used_columns`` on ``THREADS`` threads."""
    kernel = (native.draft_state.used_columns_threaded if _threaded()
              else native.draft_state.used_columns)
    return int(kernel(table, count, counts_out))


def stage_counted_inputs(*args) -> bool:
    """``native.draft_state.stage_counted_inputs`` (its arguments) on ``THREADS``
    threads."""
    kernel = (native.draft_state.stage_counted_inputs_threaded if _threaded()
              else native.draft_state.stage_counted_inputs)
    return bool(kernel(*args))


def write_counted_rows(*args) -> None:
    """``native.counts.write_counted_rows`` (its arguments) on ``THREADS`` threads."""
    kernel = (native.counts.write_counted_rows_threaded if _threaded()
              else native.counts.write_counted_rows)
    kernel(*args)
