"""Calling a kernel: ``pinned_entry``, a numba kernel's compiled entry point for one
fixed argument-type signature, to call without the dispatcher; ``kernel_optional``, the
two arguments a kernel takes for an optional array.

A numba dispatcher types every argument on every call before it reaches the compiled
code: about 200 instructions per argument and 600 per call (a 20-argument draft depth
pays about 4k of them). Where the type of every argument is pinned for as long as the
entry point is kept (arrays the library owns, the fields of one resolved destination
view, Python ints), the entry point of that one signature does the same work without
the typing. It unboxes its arguments as that signature says and checks nothing, so its
callers pass arguments of exactly the types of ``args``, always; anything else goes
through the dispatcher.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from numba import typeof

__all__ = ["pinned_entry", "kernel_optional"]


def pinned_entry(kernel: Any, args: tuple) -> Callable[..., Any]:
    """The compiled entry point of ``kernel`` (an ``@njit`` dispatcher) for the types
    of ``args``, compiled or loaded from numba's cache now if need be. Under
    ``NUMBA_DISABLE_JIT=1`` (a plain Python function) the kernel itself."""
    compile_for = getattr(kernel, "compile", None)
    if compile_for is None:
        return kernel
    return compile_for(tuple(typeof(arg) for arg in args))


_ABSENT = np.zeros(1, dtype=np.int64)  # stands in for an absent optional array


def kernel_optional(array: Optional[np.ndarray]) -> Tuple[np.ndarray, bool]:
    """``(array, present)`` for a kernel: numba kernels take a placeholder array and a
    flag instead of ``None``, so one compiled signature serves both cases."""
    return (_ABSENT, False) if array is None else (array, True)
