"""numba kernels of mtpmeta: numpy in, numpy out, never torch.

Installed as ``mtpmeta.native``. Every kernel is a plain ``@njit(cache=True)`` function
that writes into pre-allocated outputs and never raises: the wrappers in ``mtpmeta``
validate first and the kernels trust their inputs.

Modules:
    rows     -- request-row annotation lifecycle (reset, move, swap)
    carry    -- chunk-boundary carry checks
    checks   -- bound scans used by the validating wrappers
    staging  -- draft-loop and commit-pass staging, token maps, MHA metadata
"""

from . import carry, checks, rows, staging

__all__ = ["carry", "checks", "rows", "staging"]
