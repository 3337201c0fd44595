"""Device traffic per standard step of the mirror path at the production size
(``mtpmeta.bench.counters.measure_traffic``): host-to-device bytes against upstream's
flow, and data ops per step. Counts, not times, so they stay put on a busy machine and
are the same on a GPU as on the CPU-forced mirror path the CPU runs.
"""

from mtpmeta.bench.counters import measure_traffic


class TrackDeviceTraffic:
    timeout = 300

    def setup_cache(self):
        return measure_traffic(steps=2)

    def track_h2d_bytes_over_upstream_flow(self, result):
        h2d = result["h2d_bytes_per_step"]
        return h2d["mirror"] / h2d["upstream flow"]

    def track_h2d_bytes_commit_first_over_upstream_flow(self, result):
        h2d = result["h2d_bytes_per_step"]
        return h2d["mirror, commit first"] / h2d["upstream flow"]

    def track_mirror_data_ops_per_step(self, result):
        return result["ops_per_step"]["mirror"]["data_ops"]

    track_h2d_bytes_over_upstream_flow.unit = "ratio"
    track_h2d_bytes_commit_first_over_upstream_flow.unit = "ratio"
    track_mirror_data_ops_per_step.unit = "ops"
