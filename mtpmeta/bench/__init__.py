"""``mtpmeta bench``: the per-step host-cost benchmark and its parts.

Tooling, not the library: ``workload`` (the standard step), ``cli`` (the command),
``variants`` (what is compared), ``measure`` (timing, op counts, cold start),
``report`` (the table), ``floor`` (the kernel floor), ``percall`` (torch vs numpy input
cost per call), ``instructions`` (callgrind counts), ``opcount`` (a torch op counter),
``usage`` (option checks and help format, shared with ``mtpmeta simulate``).
"""

from mtpmeta.bench.cli import main

__all__ = ["main"]
