"""Instructions per standard step under valgrind's callgrind (``mtpmeta.bench.instructions``):
ratios that stay put when the machine is busy, tracked across commits.

One callgrind run (about 1-2 minutes, mostly importing torch uninstrumented) feeds every
``track_`` below through ``setup_cache``. Where valgrind or pytest-codspeed's instrument
hooks are missing, every ``track_`` is marked skipped at discovery (asv's
``skip_benchmark_if``), so asv never runs the ``setup_cache`` and the run still passes:
raising from ``setup_cache`` would count as a failure, not a skip.
"""

from asv_runner.benchmarks.mark import skip_benchmark_if

from mtpmeta.bench.instructions import count_step_instructions, unavailable
from mtpmeta.bench.workload import StepConfig

_MISSING = unavailable()  # why instructions cannot be counted here, or None
_skip_if_missing = skip_benchmark_if(_MISSING is not None)


class TrackInstructions:
    timeout = 600

    def setup_cache(self):
        return count_step_instructions(StepConfig(), steps=4)

    @_skip_if_missing
    def track_reference_over_direct_eager(self, result):
        return result["reference_over_direct_eager"]

    @_skip_if_missing
    def track_reference_over_direct_graphed(self, result):
        return result["reference_over_direct_graphed"]

    @_skip_if_missing
    def track_direct_over_kernel_floor(self, result):
        return result["direct_over_floor_eager"]

    @_skip_if_missing
    def track_direct_instructions_per_step(self, result):
        return result["per_step"]["direct torch eager"]

    track_reference_over_direct_eager.unit = "ratio"
    track_reference_over_direct_graphed.unit = "ratio"
    track_direct_over_kernel_floor.unit = "ratio"
    track_direct_instructions_per_step.unit = "instructions"
