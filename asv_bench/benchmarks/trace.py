"""The host's share of a GPU step over the seeded continuous-batching trace
(``mtpmeta.bench.trace``, standard geometry, short): µs per step of the mirror path and
of the captured draft loop on torch's ``meta`` device with the C++ meta kernels, over
the reference's (upstream's op sequence) in the same run, and the same with the launch
estimate (+4 µs per device data op); and the engine's steps through the helpers
``mtpmeta.integrations.megatron.patch()`` installs, over the reference and over the
mirror path's fused calls (what the one-call patch keeps of their gain); and the
headline, Megatron's client placement through those helpers over upstream's helpers on
the same placement, with its syncs and device data ops per step; every step inside
``torch.inference_mode()``, as the engine runs them. Ratios and counts, so a busy
machine moves them less than the times.
"""

from mtpmeta.bench.trace import STANDARD_TRACE
from mtpmeta.bench.trace_bench import ENGINE_KEY, ENGINE_REFERENCE_KEY, MEGATRON_KEY, \
    measure_trace

STEPS = 16


class TrackTraceHostShare:
    timeout = 600

    def setup_cache(self):
        return measure_trace(STANDARD_TRACE, STEPS, repeats=2)["rows"]

    def track_mirror_over_reference_meta(self, rows):
        return rows["mirror @meta"]["median_us"] / rows["reference @meta"]["median_us"]

    def track_captured_over_reference_meta(self, rows):
        return rows["captured @meta"]["median_us"] / rows["reference @meta"]["median_us"]

    def track_mirror_over_reference_launch_estimate(self, rows):
        return (rows["mirror @meta"]["launch_estimate_us"]
                / rows["reference @meta"]["launch_estimate_us"])

    def track_megatron_over_reference_meta(self, rows):
        return (rows[MEGATRON_KEY]["median_us"]
                / rows["reference @meta"]["median_us"])

    def track_megatron_over_mirror_meta(self, rows):
        return (rows[MEGATRON_KEY]["median_us"]
                / rows["mirror @meta"]["median_us"])

    def track_engine_placement_over_upstream_meta(self, rows):
        return rows[ENGINE_KEY]["median_us"] / rows[ENGINE_REFERENCE_KEY]["median_us"]

    def track_engine_placement_syncs_per_step(self, rows):
        return rows[ENGINE_KEY]["syncs"]

    def track_engine_placement_device_data_ops(self, rows):
        return rows[ENGINE_KEY]["device_data_ops"]

    track_engine_placement_over_upstream_meta.unit = "ratio"
    track_engine_placement_syncs_per_step.unit = "syncs"
    track_engine_placement_device_data_ops.unit = "ops"
    track_mirror_over_reference_meta.unit = "ratio"
    track_captured_over_reference_meta.unit = "ratio"
    track_mirror_over_reference_launch_estimate.unit = "ratio"
    track_megatron_over_reference_meta.unit = "ratio"
    track_megatron_over_mirror_meta.unit = "ratio"
