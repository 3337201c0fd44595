"""``mtpmeta bench``: the per-step host-cost benchmark and its parts.

Tooling, not the library. The command (``cli``, with the option handling it shares with
``mtpmeta simulate``) runs either the standard step or the seeded trace:

* the standard step: ``workload`` (the step and its seeded inputs), ``variants`` (the
  rows compared, their agreement check, the kernel floor), ``measure`` (timing),
  ``report`` (what is printed), ``instructions`` (callgrind counts);
* the trace (``--trace``): ``trace`` (the seeded engine model), ``trace_replay`` (each
  path replaying it, and their agreement check), ``engine_context``,
  ``upstream_helpers`` and ``engine_placement`` (an engine context with the helpers
  ``patch()`` installs or upstream's, and Megatron's client placement),
  ``trace_bench`` (its rows and timing), ``trace_report`` (what is printed),
  ``meta_device`` (torch's meta device with its C++ kernels);
* ``counters``: torch ops, bytes host-to-device and CUDA runtime calls, for both and for
  the tests.
"""

from mtpmeta.bench.cli import main

__all__ = ["main"]
