"""Instructions per standard step under valgrind's callgrind (``mtpmeta.bench.instructions``):
ratios that stay put when the machine is busy, tracked across commits.

One callgrind run (about 1-2 minutes, mostly importing torch uninstrumented) feeds every
``track_`` below through ``setup_cache``. Skipped where valgrind or pytest-codspeed's
instrument hooks are missing.
"""

from mtpmeta.bench.instructions import count_step_instructions, unavailable
from mtpmeta.bench.workload import StepConfig


class TrackInstructions:
    timeout = 600

    def setup_cache(self):
        reason = unavailable()
        if reason:
            raise NotImplementedError(reason)
        return count_step_instructions(StepConfig(), steps=4)

    def track_reference_over_direct_eager(self, result):
        return result["reference_over_direct_eager"]

    def track_reference_over_direct_graphed(self, result):
        return result["reference_over_direct_graphed"]

    def track_direct_over_kernel_floor(self, result):
        return result["direct_over_floor_eager"]

    def track_direct_instructions_per_step(self, result):
        return result["per_step"]["direct torch eager"]

    track_reference_over_direct_eager.unit = "ratio"
    track_reference_over_direct_graphed.unit = "ratio"
    track_direct_over_kernel_floor.unit = "ratio"
    track_direct_instructions_per_step.unit = "instructions"
