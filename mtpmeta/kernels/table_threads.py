"""The opt-in threads of the mirror path's table passes: the derived route's scan
(``used_columns``) and the packed-row copies of a begin and a commit pass with counts
(``stage_counted_inputs``, ``write_counted_rows``), derived or the caller's.

``THREADS`` 1 (the default) runs each on the calling thread. Above 1 (environment
``MTPMETA_TABLE_THREADS`` at import, or this attribute, read at each call) each pass
splits its rows over that many of numba's threads (the ``*_threaded`` kernels:
``parallel=True``, the same writes and results). It pays where the table passes are a
step's host cost: wide tables, hundreds of rows (BENCHMARKS.md, the production trace).

What a threaded pass costs the process:

- **A fork-safe threading layer.** numba starts one threading layer per process, at
  its first parallel launch, and keeps it. GNU OpenMP (numba's usual pick on Linux)
  kills or hangs a forked child at its first parallel launch once the parent ran one,
  and engines fork workers. So the first threaded pass, when no parallel launch came
  before it and ``NUMBA_THREADING_LAYER`` is unset, starts numba's ``forksafe`` choice:
  ``tbb`` where the ``tbb`` package is importable, else numba's own ``workqueue``
  (``threading_layer``). A process whose layer is already one a child cannot use
  (``omp`` on Linux: set by ``NUMBA_THREADING_LAYER``, or started by a parallel kernel
  or a ``numba.get_num_threads``/``set_num_threads`` call that came first) gets a
  RuntimeError at each threaded pass, saying so: the pass is refused, not run on it
  (``MTPMETA_TABLE_THREADS=1`` runs it on the calling thread). The refusal comes
  where the call reaches its table pass, part-way through its staging: a setup error
  to fix before serving, not one to catch and carry on from.
- **The workqueue is not thread-safe**: two threads inside its parallel kernels at once
  abort the process. The passes hold a lock around each launch on it, so two threads
  running table passes take turns; other numba parallel code in the process shares
  the limit and must not run beside them.
- **The thread count is the caller's again after each pass**: a pass sets numba's count
  on the calling thread (``numba.set_num_threads``, thread-local) to ``THREADS`` for its
  launch and restores what it was (two more of numba's calls, about 2 µs a pass).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Optional

import numba
import numpy as np

from mtpmeta.kernels.loader import native

__all__ = ["THREADS", "FORK_SAFE", "threads_from", "threading_layer", "used_columns",
           "stage_counted_inputs", "write_counted_rows"]

#: numba's threading layers a forked child can launch on (numba's ``forksafe`` set:
#: OpenMP only off Linux, where it is not GNU's).
FORK_SAFE = ("tbb", "workqueue") + (() if sys.platform.startswith("linux") else ("omp",))


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

_layer: Optional[str] = None  # numba's layer, once a threaded pass found it fork-safe
_launch_lock = threading.Lock()  # one launch at a time on the workqueue layer
_choice_lock = threading.Lock()  # one start of numba's layer by the passes


def _started_layer() -> Optional[str]:
    """numba's threading layer if a parallel launch started one, else None."""
    try:
        return numba.threading_layer()
    except ValueError:  # "Threading layer is not initialized."
        return None


def threading_layer() -> str:
    """The threading layer of the threaded passes (module docstring): the one numba
    started, else numba's ``forksafe`` choice started now (``tbb``, else
    ``workqueue``; ``NUMBA_THREADING_LAYER``, when set, is numba's to honour).
    RuntimeError, naming the layer, where it is not in ``FORK_SAFE``."""
    global _layer
    if _layer is not None:
        return _layer
    with _choice_lock:  # one thread sets numba's config and starts the layer
        layer = _started_layer()
        if layer is None:
            config = numba.config
            chosen = config.THREADING_LAYER
            if str(chosen).lower() == "default":
                config.THREADING_LAYER = "forksafe"
            try:
                numba.get_num_threads()  # starts numba's threads on the layer configured
            finally:
                config.THREADING_LAYER = chosen
            layer = numba.threading_layer()
    if layer not in FORK_SAFE:
        raise RuntimeError(
            f"MTPMETA_TABLE_THREADS={THREADS}: the table threads need a fork-safe numba "
            f"threading layer ({' or '.join(FORK_SAFE)}), and this process runs numba's "
            f"parallel kernels on {layer!r}, which a forked child cannot use; set "
            f"NUMBA_THREADING_LAYER=forksafe before any numba parallel kernel runs, or "
            f"MTPMETA_TABLE_THREADS=1")
    _layer = layer
    return layer


def _run(kernel: Callable[..., Any], threaded: Callable[..., Any], args: tuple) -> Any:
    """``kernel(*args)``, or ``threaded(*args)`` on ``THREADS`` of numba's threads of a
    fork-safe layer, the calling thread's numba count restored after it."""
    threads = THREADS
    if threads <= 1:
        return kernel(*args)
    layer = threading_layer()
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        if layer == "workqueue":
            with _launch_lock:
                return threaded(*args)
        return threaded(*args)
    finally:
        numba.set_num_threads(previous)


def used_columns(table: np.ndarray, count: int, counts_out: np.ndarray) -> int:
    """``native.draft_state.used_columns`` on ``THREADS`` threads."""
    return int(_run(native.draft_state.used_columns,
                    native.draft_state.used_columns_threaded, (table, count, counts_out)))


def stage_counted_inputs(*args) -> bool:
    """``native.draft_state.stage_counted_inputs`` (its arguments) on ``THREADS``
    threads."""
    return bool(_run(native.draft_state.stage_counted_inputs,
                     native.draft_state.stage_counted_inputs_threaded, args))


def write_counted_rows(*args) -> None:
    """``native.counts.write_counted_rows`` (its arguments) on ``THREADS`` threads."""
    _run(native.counts.write_counted_rows, native.counts.write_counted_rows_threaded,
         args)
